"""One run's handle: its store, the run's keys in it, this node's cache and the run's name.

`Run.of(config)` opens `config.store` once; what works on the run takes the handle rather than opening the
store again from the config. A Prefect task gets the config (it serializes) and opens the handle inside,
once per task; a stage process opens it once and hands it down.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmyard.config import RunConfig
from lmyard.layout import RunLayout
from lmyard.paths import cache_root
from lmyard.store import Store, open_store


@dataclass(frozen=True)
class Run:
    """`name`: the lineage (`runs/<name>`); `store`: config.store, opened; `layout`: the run's keys in it;
    `cache`: this node's cache root (LMYARD_CACHE). What works on a lineage's state in the store (its
    checkpoints, lease, lineage record) takes this handle, never a store and a name apart."""

    name: str
    store: Store
    cache: str = field(default_factory=cache_root)

    @classmethod
    def of(cls, config: RunConfig) -> Run:
        return cls(config.run_name, open_store(config.store))

    @property
    def layout(self) -> RunLayout:
        """The run's keys: the one place a lineage's RunLayout is made."""
        return RunLayout(self.name)

    def uri(self, key: str) -> str:
        """The store URI of a key (e.g. `run.uri(run.layout.step(4))`)."""
        return self.store.uri(key)
