"""Small real models and loss functions for the sample scenarios, referenced as ``samples.models:NAME``.

The recorder stores ``factory`` and ``loss_fn`` by name, and ``analyzer replay`` rebuilds the
model offline as ``build_*(**factory_kwargs)``, so everything a scenario trains is a top-level
function here. Each model has config flags for the failure it demonstrates:

- :class:`GPT` (``build_gpt``): token + positional embedding, pre-norm blocks with multi-head
  attention and an MLP, residuals, a final norm and an LM head. ``scale_attn_logits=False``
  drops the ``1/sqrt(head_dim)`` factor; ``pad_mask=True`` masks padded keys with ``-inf``;
  ``attn_temperature=True`` divides the logits by a temperature the training loop sets
  (:func:`set_attn_temperature`).
- :class:`MLP` (``build_mlp``): a deep fully connected classifier without residual
  connections. ``activation="sigmoid"`` and a small ``init_std`` make gradients vanish
  through depth; ``standardize=True`` standardises the input features per batch *without*
  an eps.
- :class:`CNN` (``build_cnn``): a small conv net whose activation is the custom op
  ``samples::softplus``, registered with ``torch.library`` but *not* with autocast.

A loss function takes ``(model, batch)`` and returns a scalar tensor: the same call the
training loop makes under autocast and the replay makes in each precision.

Example:
    >>> model = build_gpt(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16)
    >>> batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "targets": torch.zeros(2, 8, dtype=torch.long)}
    >>> gpt_loss(model, batch).shape
    torch.Size([])
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig", "GPT", "build_gpt", "gpt_loss", "gpt_masked_loss", "set_attn_temperature",
    "MLPConfig", "MLP", "build_mlp", "mlp_loss", "mlp_nll_loss",
    "CNNConfig", "CNN", "build_cnn", "cnn_loss", "softplus",
]


# --------------------------------------------------------------------------- tiny GPT

@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    scale_attn_logits: bool = True   # False: the fp16_attention_overflow bug
    pad_mask: bool = False           # mask padded keys with -inf (masked_padding)
    attn_temperature: bool = False   # logits divided by a temperature the loop sets (fp16_attention_overflow)
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.norm_eps < 0:
            raise ValueError(f"GPTConfig.norm_eps must be >= 0, got {self.norm_eps}")


class CausalSelfAttention(nn.Module):
    """Multi-head attention written out op by op, so the replay can see each matmul."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        # No key bias: it adds q.b_k to every logit of a query row, which softmax ignores, so its
        # gradient is zero up to rounding and a trace shows it as a stalled parameter.
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.scale = 1.0 / math.sqrt(self.head_dim) if cfg.scale_attn_logits else 1.0
        if cfg.attn_temperature:
            # A buffer, not an attribute: it is in the state_dict, so a snapshot holds the value
            # the failing step used and the replay sees the same logits.
            self.register_buffer("temperature", torch.ones(()))
        causal = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal", causal.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        if hasattr(self, "temperature"):
            # q.k / tau, with tau^-1/2 applied to q and to k before the matmul (as guided-diffusion
            # does, "more stable with f16 than dividing afterwards"): q and k stay small, and only
            # the matmul's output carries the full 1/tau.
            s = self.temperature.rsqrt()
            q, k = q * s, k * s
        att = q @ k.transpose(-2, -1)
        if self.scale != 1.0:
            att = att * self.scale
        mask = ~self.causal[:, :, :T, :T]
        if pad is not None:
            # NB: a row whose every key is padding is all -inf, and softmax of it is 0/0 = NaN.
            mask = mask | pad.view(B, 1, 1, T)
        att = att.masked_fill(mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.out_proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), pad)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A tiny GPT: nanoGPT's shape (pre-norm blocks, residuals, final norm, LM head)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(_init_gpt_weights)

    def forward(self, idx: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x, pad if self.cfg.pad_mask else None)
        return self.lm_head(self.ln_f(x))


def set_attn_temperature(model: GPT, tau: float) -> None:
    """Set every block's attention temperature: the logits become ``q.k / tau``.

    Needs ``attn_temperature=True``. The value is written in place into each block's
    ``temperature`` buffer before the step, so the step's snapshot records it.
    """
    for block in model.blocks:
        block.attn.temperature.fill_(tau)


def _init_gpt_weights(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def build_gpt(**kwargs) -> GPT:
    """Factory: ``GPT(GPTConfig(**kwargs))``; the recorder stores ``kwargs`` as factory_kwargs."""
    return GPT(GPTConfig(**kwargs))


def gpt_loss(model: GPT, batch: dict) -> torch.Tensor:
    """Next-token cross entropy over every position: ``batch = {"idx", "targets"}`` (B, T) int64."""
    logits = model(batch["idx"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


def gpt_masked_loss(model: GPT, batch: dict) -> torch.Tensor:
    """Cross entropy averaged over real tokens only; ``batch["pad"]`` (B, T) is True at padding.

    The per-token losses are multiplied by the keep mask, as many hand-written loops do: a NaN at
    a padded position survives ``NaN * 0`` and reaches the loss.
    """
    pad = batch["pad"]
    logits = model(batch["idx"], pad)
    per_token = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none")
    keep = (~pad).flatten().to(per_token.dtype)
    return (per_token * keep).sum() / keep.sum().clamp(min=1)


# --------------------------------------------------------------------------- deep MLP

@dataclass
class MLPConfig:
    in_features: int = 16
    width: int = 64
    depth: int = 4
    n_classes: int = 4
    activation: str = "relu"   # "relu" | "sigmoid" | "tanh"
    init_std: float | None = None  # None: PyTorch's default init
    standardize: bool = False  # per-batch (x - mean) / std on the inputs, with no eps (bf16_nan)

    def __post_init__(self):
        for name in ("in_features", "width", "depth", "n_classes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"MLPConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"MLPConfig.activation must be one of {sorted(_ACTIVATIONS)}, got {self.activation!r}")
        if self.init_std is not None and self.init_std <= 0:
            raise ValueError(f"MLPConfig.init_std must be > 0 or None, got {self.init_std}")


_ACTIVATIONS = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}


class BatchStandardize(nn.Module):
    """``(x - mean) / std`` over the batch, per feature. NB: no eps, on purpose (bf16_nan)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(dim=0)) / x.std(dim=0)


class MLP(nn.Module):
    """``depth`` hidden Linear+activation layers (``layers.0`` is the first), then ``head``."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        self.norm = BatchStandardize() if cfg.standardize else nn.Identity()
        layers, d = [], cfg.in_features
        for _ in range(cfg.depth):
            layers += [nn.Linear(d, cfg.width), _ACTIVATIONS[cfg.activation]()]
            d = cfg.width
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(d, cfg.n_classes)
        if cfg.init_std is not None:
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=cfg.init_std)
                    nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.norm(x)))


def build_mlp(**kwargs) -> MLP:
    """Factory: ``MLP(MLPConfig(**kwargs))``."""
    return MLP(MLPConfig(**kwargs))


def mlp_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Cross entropy: ``batch = {"x": (B, F) float, "y": (B,) int64}``."""
    return F.cross_entropy(model(batch["x"]), batch["y"])


def mlp_nll_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """A hand-written NLL: ``-log(softmax(logits))`` at the target (the log_zero bug).

    The softmax runs in FP32 (``.float()``), the usual precaution, and it does not help:
    once a target's probability rounds to exactly 0, ``log`` returns ``-inf`` in any
    precision. ``F.cross_entropy`` (log-softmax) would have stayed finite.
    """
    probs = F.softmax(model(batch["x"]).float(), dim=-1)
    return -torch.log(probs).gather(1, batch["y"].unsqueeze(1)).mean()


# --------------------------------------------------------------------------- small CNN

@torch.library.custom_op("samples::softplus", mutates_args=())
def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x))``, a hand-fused kernel computed in whatever dtype it receives.

    NB: there is no ``torch.library.register_autocast`` for it, so under FP16 autocast it gets
    FP16 inputs, and ``exp`` overflows to ``inf`` once an input exceeds log(65504) ~= 11.09.
    (``F.softplus`` returns ``x`` above a threshold and never evaluates that ``exp``; in FP32
    this formula is finite up to ~88.)
    """
    return torch.log(1 + torch.exp(x))


@softplus.register_fake
def _softplus_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _softplus_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _softplus_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return grad * torch.sigmoid(x)


softplus.register_autograd(_softplus_backward, setup_context=_softplus_setup)


class FusedSoftplus(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softplus(x)


@dataclass
class CNNConfig:
    in_channels: int = 1
    image_size: int = 12
    channels: int = 8
    n_classes: int = 4

    def __post_init__(self):
        for name in ("in_channels", "image_size", "channels", "n_classes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"CNNConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size % 4:
            raise ValueError(f"CNNConfig.image_size must be a multiple of 4, got {self.image_size}")


class CNN(nn.Module):
    """conv-act-pool, conv-act-pool, linear head; the activation is the custom op ``samples::softplus``."""

    def __init__(self, cfg: CNNConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg.channels
        self.features = nn.Sequential(
            nn.Conv2d(cfg.in_channels, c, 3, padding=1), FusedSoftplus(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), FusedSoftplus(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * c * (cfg.image_size // 4) ** 2, cfg.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def build_cnn(**kwargs) -> CNN:
    """Factory: ``CNN(CNNConfig(**kwargs))``."""
    return CNN(CNNConfig(**kwargs))


def cnn_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Cross entropy: ``batch = {"x": (B, C, H, W) float, "y": (B,) int64}``."""
    return F.cross_entropy(model(batch["x"]), batch["y"])
