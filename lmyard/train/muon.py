"""train.optimizer=muon: torch.optim.Muon for the blocks' matrices, lmyard's AdamW for the rest, as one optimizer.

`split(model, weight_decay)`: every 2-D parameter of `model.layers` to Muon; the tables, the head, norms and biases
to AdamW's groups; each parameter in exactly one group. `MuonAdamW` shows both as one optimizer (AdamW's groups
then Muon's, one state dict), so checkpoints and exact resume see one. torch's Muon serves as it is (the same
signature in torch 2.11 and 2.13). A Muon group's `lr_ratio` (muon_lr / lr) makes it follow the schedule; the
clip's scale applies to both. Refused under FSDP2 (TrainConfig). Design: docs/training.md.
"""

from __future__ import annotations

import torch

from lmyard.train.optim import AdamW, _scale_grads

LR_RATIO = "lr_ratio"  # a Muon group's lr as a multiple of the schedule's (AdamW's) lr


def split(model: torch.nn.Module, weight_decay: float) -> tuple[list[torch.Tensor], list[dict]]:
    """(the blocks' matrices for Muon, AdamW's groups of every other parameter: decay on matrices, none on
    vectors). `model.layers` is the ModuleList of blocks (lmyard.models.base.LanguageModel)."""
    hidden = {id(p): p for p in model.layers.parameters() if p.requires_grad and p.dim() == 2}  # type: ignore[union-attr]
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in hidden]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    return list(hidden.values()), groups


class MuonAdamW(torch.optim.Optimizer):
    """AdamW (lmyard.train.optim.AdamW) over `adamw_groups` and torch.optim.Muon over `hidden`, as one optimizer:
    `param_groups` is AdamW's groups then Muon's, `state` is shared (see the module doc)."""

    takes_grad_scale = True  # lmyard.train.optim.clipped_update hands the clip's scale to step()

    def __init__(
        self, adamw_groups: list[dict], hidden: list[torch.Tensor], *, adamw: dict, muon: dict, lr_ratio: float
    ):
        self.adamw = AdamW(adamw_groups, **adamw)
        self.muon = torch.optim.Muon([{"params": hidden, LR_RATIO: lr_ratio}], **muon)
        super().__init__(self.adamw.param_groups + self.muon.param_groups, {})
        self._link()

    def _link(self) -> None:
        """Point both optimizers at this one's groups and state (after a load replaced them)."""
        n = len(self.adamw.param_groups)
        self.adamw.param_groups, self.muon.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.adamw.state = self.muon.state = self.state

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None):
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        self.adamw.step(grad_scale=grad_scale)
        if grad_scale is not None:
            _scale_grads([p for g in self.muon.param_groups for p in g["params"]], grad_scale)
        self.muon.step()
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()


def build(model: torch.nn.Module, t, fused: bool) -> MuonAdamW:
    """The optimizer of train.optimizer=muon over `model`'s parameters (t: the TrainConfig)."""
    hidden, groups = split(model, t.weight_decay)
    return MuonAdamW(
        groups,
        hidden,
        adamw={"lr": t.lr, "betas": (t.beta1, t.beta2), "fused": fused},
        muon={"lr": t.muon_lr, "momentum": t.muon_momentum, "weight_decay": t.muon_weight_decay},
        lr_ratio=t.muon_lr / t.lr,
    )
