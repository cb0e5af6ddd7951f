"""The `data` and `tokenizer` sections: what is tokenized, and how."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lmyard.config.base import _Section


class SourceConfig(_Section):
    """One source of a mixture (`data.sources`): where its documents come from and its share."""

    source: str = Field(
        ...,
        description="Hub dataset name, local file/glob (txt, jsonl, parquet), s3:// URI, or `builtin:pydoc-topics`.",
    )
    name: str | None = Field(None, description="Hub dataset config name.")
    split: str = Field("train", description="Dataset split to read.")
    revision: str | None = Field(None, description="Hub dataset revision (commit).")
    text_field: str = Field("text", description="Field that holds each document's text.")
    weight: float | None = Field(
        None,
        description="Relative share of the mixture's tokens (e.g. 3 and 1: 75% and 25%); the mixture ends "
        "when the first source runs out. Default 1 when no source sets `tokens`.",
    )
    tokens: int | None = Field(
        None,
        description="Token budget instead of a weight: the source gives this many tokens (its documents "
        "read again from the start if it runs out first); set it on every source or on none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_tokenizer(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tokenizer" in data:
            raise ValueError(
                "a shard set has one tokenizer, the `tokenizer` section: sources with different "
                "tokenizers cannot be mixed; remove `tokenizer` here or shard the sources separately"
            )
        return data

    @field_validator("weight")
    @classmethod
    def _positive_weight(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(
                f"weight must be positive (got {v}): weights are relative shares, e.g. 3 and 1 "
                "for 75% and 25%; leave a source out instead of giving it 0"
            )
        return v

    @field_validator("tokens")
    @classmethod
    def _positive_tokens(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"tokens must be a positive token budget (got {v})")
        return v


class DataConfig(_Section):
    source: str = Field(
        "builtin:pydoc-topics",
        description="Hub dataset name, local file/glob (txt, jsonl, parquet), s3:// URI, "
        "or `builtin:pydoc-topics` (CPython's bundled documentation, ~465 KB). See `data.sources` for mixtures.",
    )
    sources: list[SourceConfig] | None = Field(
        None,
        description="A mixture instead of `data.source`: a list of {source, text_field, name, split, "
        "revision, and weight or tokens}, interleaved document by document so that each source's share of the tokens "
        "follows its weight (or budget). The content address covers every source and its share.",
    )
    name: str | None = Field(None, description="Hub dataset config name (e.g. `sample-10BT`).")
    split: str = Field("train", description="Dataset split to read.")
    revision: str | None = Field(None, description="Hub dataset revision (commit); pins the content address.")
    text_field: str = Field("text", description="Field that holds each document's text.")
    shard_tokens: int = Field(100_000_000, gt=0, description="Tokens per shard file.")
    val_every: int = Field(10, ge=2, description="Split rule: document i goes to validation when i % val_every == 0.")
    max_documents: int | None = Field(None, gt=0, description="Stop after this many documents (smoke runs).")
    on_decode_error: Literal["error", "skip"] = Field(
        "error",
        description="Non-UTF-8 bytes in a .txt/.jsonl file: `error` stops and names the file and byte offset; "
        "`skip` drops the documents holding them (with a counted warning).",
    )
    num_proc: int | None = Field(
        None, gt=0, description="Tokenizer processes; default: every core. The shards do not depend on it."
    )
    shuffle_documents: bool = Field(
        False,
        description="Shard time: shuffle the documents before they are split and written (file pieces in "
        "a seeded order, then a seeded shuffle buffer), so similar files do not arrive together. Changes the "
        "shard set (the seed is in its address).",
    )
    shuffle_seed: int = Field(0, description="Seed of data.shuffle_documents (part of the content address).")
    shuffle_buffer_tokens: int = Field(
        16_000_000,
        gt=0,
        description="Tokens held by the document shuffle buffer (2-4 bytes each): "
        "the larger, the more global the shuffle.",
    )
    shuffle_sequences: bool = Field(
        False,
        description="Training time: read the train split's sequences in a seeded order that changes every "
        "epoch (seed: train.seed). Leaves the shards alone; resume stays exact, the order is the same for any "
        "number of ranks.",
    )

    @model_validator(mode="after")
    def _one_kind_of_share(self) -> DataConfig:
        if self.sources is None:
            return self
        if not self.sources:
            raise ValueError("data.sources is empty: list at least one source, or use data.source")
        if self.source != DataConfig.model_fields["source"].default:  # not model_fields_set: JSON round trips set all
            raise ValueError("set data.source or data.sources, not both")
        budgets = [s.tokens is not None for s in self.sources]
        if any(budgets) and not all(budgets):
            raise ValueError("data.sources: give every source a token budget (`tokens`) or none")
        if any(budgets) and any(s.weight is not None for s in self.sources):
            raise ValueError("data.sources: a source has `weight` and `tokens`; shares come from one or the other")
        return self

    def source_configs(self) -> list[DataConfig]:
        """Each source as a single-source DataConfig (the mixture's members, or this config alone)."""
        if self.sources is None:
            return [self]
        keys = ("source", "name", "split", "revision", "text_field")
        return [self.model_copy(update={**{k: getattr(s, k) for k in keys}, "sources": None}) for s in self.sources]

    def shares(self) -> tuple[list[float], list[int] | None]:
        """(relative weights, token budgets or None) of the sources, in order."""
        if self.sources is None:
            return [1.0], None
        if self.sources[0].tokens is not None:
            budgets = [s.tokens for s in self.sources if s.tokens is not None]  # all or none (_one_kind_of_share)
            return [float(b) for b in budgets], budgets
        return [s.weight if s.weight is not None else 1.0 for s in self.sources], None


class TokenizerConfig(_Section):
    name: str = Field(
        "bytes",
        description="`bytes` (256 byte tokens + end-of-text, built in code) or a tiktoken "
        "encoding: gpt2 / r50k_base, p50k_base, cl100k_base, o200k_base.",
    )
    ranks_file: str | None = Field(
        None, description="A .tiktoken ranks file (local path or s3:// URI) for the named encoding."
    )
    file: str | None = Field(
        None,
        description="A Hugging Face `tokenizers` tokenizer.json instead of tokenizer.name: a local path, "
        "an s3:// URI, or `hf://ORG/REPO` (`hf://ORG/REPO@REVISION`) from the hub. Declare its document "
        "separator with tokenizer.bos and/or tokenizer.eos.",
    )
    bos: str | None = Field(
        None,
        description="Special token written before every document. Default for tiktoken encodings and "
        "`bytes`: their end-of-text token (llm.c's convention); for a tokenizer.json e.g. Llama 3's begin-of-text "
        "token or `<s>`.",
    )
    eos: str | None = Field(None, description="Special token written after every document (e.g. `</s>`); default none.")

    @model_validator(mode="after")
    def _one_kind(self) -> TokenizerConfig:
        if self.file is not None and self.name != TokenizerConfig.model_fields["name"].default:
            raise ValueError("set tokenizer.name (tiktoken) or tokenizer.file (tokenizer.json), not both")
        if self.file is not None and self.ranks_file is not None:
            raise ValueError("tokenizer.ranks_file belongs to tiktoken encodings; unset it with tokenizer.file")
        if self.file is not None and self.bos is None and self.eos is None:
            raise ValueError(
                "tokenizer.file needs tokenizer.bos or tokenizer.eos: name the special token that "
                "separates documents (e.g. `<|begin_of_text|>`, `<s>` or `</s>`)"
            )
        return self
