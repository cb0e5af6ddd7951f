"""train.optimizer=muon: torch.optim.Muon for the blocks' matrices, lmyard's AdamW for the rest, as one optimizer.

The split (`split`), as the GPT-2 speedrun (KellerJordan/modded-nanogpt) makes it: every 2-D parameter of the
blocks (`model.layers`: attention's and the MLP's matrices) goes to Muon; the token and position tables, the
output head (tied to the token table in GPT-2), norms and biases go to AdamW, with its usual groups (decay on
matrices, none on vectors). Each parameter lands in exactly one group.

`MuonAdamW` holds both optimizers and shows their groups as one list (AdamW's first) over one state dict, so
torch's `state_dict()`/`load_state_dict()` and lmyard's checkpoints see one optimizer: a checkpoint holds
AdamW's moments and Muon's momentum buffers by parameter index, and a resumed run continues bit for bit.

torch.optim.Muon (torch 2.9+; the signature `Muon(params, lr, weight_decay, momentum, nesterov,
ns_coefficients, eps, ns_steps, adjust_lr_fn)` is the same in torch 2.11 and 2.13) serves as it is: its step
is momentum (`buf.lerp_(g, 1 - momentum)`), Nesterov's `g.lerp(buf, momentum)`, five Newton-Schulz
iterations in bf16, decoupled decay and the update scaled by sqrt(max(1, rows/cols)) ("original", Keller
Jordan's rule). A Muon group carries `lr_ratio` = train.muon_lr / train.lr: the schedule's lr times it is
Muon's lr at each step (lmyard.train.trainer.train_step), so warmup and decay apply to both.

The clip's scale (lmyard.train.optim.clipped_update) applies to both: AdamW reads it in its kernel, Muon's
gradients are scaled in place before its step. Under FSDP2 it is refused before training (TrainConfig): a
shard of rows is not the matrix Muon orthogonalises.
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
