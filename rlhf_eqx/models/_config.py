"""Configuration of the decoder: sizes plus small named architecture switches."""

import dataclasses
import math
import numbers

import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Float32

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_ROPE_KINDS = ("linear", "llama3", "yarn")
_ROPE_OPTIONAL = ("mscale", "mscale_all_dim", "attention_factor")
_ROPE_NUMBERS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position",
    "beta_fast",
    "beta_slow",
    *_ROPE_OPTIONAL,
)


_ROPE_READS = {
    "linear": ("kind", "factor"),
    "llama3": ("kind", "factor", "low_freq_factor", "high_freq_factor", "original_max_position"),
    "yarn": (
        "kind",
        "factor",
        "original_max_position",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
}
"""The fields of `RopeScaling` each kind reads; the others hold their defaults."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rescaled rotary frequencies for long contexts.

    **Arguments:**

    - `kind`: `"linear"` (position interpolation, Chen et al. 2023: every inverse
      frequency divided by `factor`), `"llama3"` (Meta's Llama 3.1 rule: wavelengths
      longer than `original_max_position / low_freq_factor` are divided by `factor`,
      shorter than `original_max_position / high_freq_factor` are kept, and the band
      between is interpolated smoothly) or `"yarn"` (YaRN, Peng et al. 2023,
      arXiv:2309.00071, as transformers' `_compute_yarn_parameters` computes it; see
      `yarn_inv_freq`).
    - `factor`: the context extension factor.
    - `low_freq_factor`, `high_freq_factor`, `original_max_position`: the `llama3`
      parameters (Hugging Face `rope_scaling` fields `low_freq_factor`,
      `high_freq_factor`, `original_max_position_embeddings`); `original_max_position`
      is YaRN's pretraining context too (`config_from_hf` fills it with
      `max_position_embeddings` when `rope_scaling` leaves it out, as transformers does).
    - `beta_fast`, `beta_slow`: YaRN's rotation counts bounding the ramp between
      extrapolated and interpolated frequencies (transformers' defaults 32 and 1).
    - `mscale`, `mscale_all_dim`: YaRN's attention-factor multipliers (DeepSeek's
      fields; both set and nonzero: `attention_factor = m(factor, mscale) /
      m(factor, mscale_all_dim)` with `m(s, k) = 0.1·k·ln s + 1` for `s > 1`, else 1).
    - `attention_factor`: YaRN's scale of the cos / sin tables (`None`: from `mscale`
      / `mscale_all_dim`, or `0.1·ln(factor) + 1`; see `attention_scale`).
    - `truncate`: round YaRN's ramp bounds outward to whole dimensions (transformers'
      default `True`; gpt-oss writes `false`).

    The numbers must be finite; NumPy scalars are stored as Python numbers (so that
    `save_hf` and `save_gguf` write them). A field the kind does not read holds its
    default (a `linear` scaling's `original_max_position`, which some `config.json`
    files give, is not kept), so that two scalings that compute the same frequencies
    are equal.
    """

    kind: str
    factor: float | numbers.Real
    low_freq_factor: float | numbers.Real = 1.0
    high_freq_factor: float | numbers.Real = 4.0
    original_max_position: int | numbers.Integral = 8192
    beta_fast: float | numbers.Real = 32.0
    beta_slow: float | numbers.Real = 1.0
    mscale: float | numbers.Real | None = None
    mscale_all_dim: float | numbers.Real | None = None
    attention_factor: float | numbers.Real | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in _ROPE_KINDS:
            raise ValueError(f"RopeScaling.kind must be one of {_ROPE_KINDS}, got {self.kind!r}")
        for name in _ROPE_NUMBERS:  # numpy scalars stored as Python numbers, as JSON takes
            value = getattr(self, name)
            if value is None and name in _ROPE_OPTIONAL:
                continue
            integral = name == "original_max_position"
            kind = numbers.Integral if integral else numbers.Real
            if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
                what = "an int" if integral else "a finite number"
                raise ValueError(f"RopeScaling.{name} must be {what}, got {value!r}")
            if type(value) not in (int, float):  # np.float64 too, a float subclass
                plain = int(value) if isinstance(value, numbers.Integral) else float(value)
                object.__setattr__(self, name, plain)
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be positive, got {self.factor!r}")
        for f in dataclasses.fields(self):  # one value for what the kind does not read
            if f.name not in _ROPE_READS[self.kind]:
                object.__setattr__(self, f.name, f.default)
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "RopeScaling.high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor!r} <= {self.low_freq_factor!r}"
            )
        if self.kind != "yarn":
            return
        orig = self.original_max_position
        if orig <= 0:
            raise ValueError(
                f"RopeScaling.original_max_position must be a positive int, got {orig!r}"
            )
        for name in ("beta_fast", "beta_slow"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"RopeScaling.{name} must be a positive number, got {value!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"RopeScaling.truncate must be True or False, got {self.truncate!r}")

    @property
    def attention_scale(self) -> float:
        """The factor YaRN multiplies the cos / sin tables by (1 for the other kinds), as
        transformers' `_compute_yarn_parameters` returns it: `attention_factor` when
        set, else `m(factor, mscale) / m(factor, mscale_all_dim)` when both are set and
        nonzero, else `m(factor, 1)`, with `m(s, k) = 0.1·k·ln s + 1` (1 when `s ≤ 1`).
        Both queries and keys are scaled, so the attention logits grow by its square."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def m(scale: float, k: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(m(self.factor, self.mscale) / m(self.factor, self.mscale_all_dim))
        return m(self.factor)

    def yarn_range(self, dim: int, theta: float) -> tuple[int | float, int | float]:
        """YaRN's ramp bounds `(low, high)` over the `dim / 2` frequency indices: the
        index `d(r) = dim·ln(original_max_position / (2π r)) / (2 ln theta)` at which a
        frequency turns `r` times over the pretraining context, for `r = beta_fast` and
        `beta_slow` (rounded down / up with `truncate`), clipped to `[0, dim - 1]`."""

        def d(rotations: float) -> float:
            orig = self.original_max_position
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = d(self.beta_fast), d(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def yarn_inv_freq(self, theta: float, dim: int) -> Float32[np.ndarray, " half"]:
        """YaRN's inverse frequencies `[dim / 2]` (float32, as transformers computes them):
        with `p_i = theta^(2i / dim)`, `γ_i = clip((i - low) / (high - low), 0, 1)` (the
        ramp between `yarn_range`'s bounds; `high` nudged by 0.001 when equal to `low`),
        `inv_i = (1 / (factor·p_i))·γ_i + (1 / p_i)·(1 - γ_i)`: high frequencies (below
        `low`) are kept, low frequencies (above `high`) interpolated by `factor`."""
        exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
        pos = (np.float32(theta) ** exponent).astype(np.float32)
        extrapolation = (np.float32(1.0) / pos).astype(np.float32)
        interpolation = (np.float32(1.0) / (np.float32(self.factor) * pos)).astype(np.float32)
        low, high = self.yarn_range(dim, theta)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
        keep = np.float32(1.0) - np.clip(ramp, 0, 1).astype(np.float32)
        out = interpolation * (np.float32(1.0) - keep) + extrapolation * keep
        return out.astype(np.float32)

    def apply(self, inv_freq: Float[np.ndarray, " half"]) -> Float32[np.ndarray, " half"]:
        """The rescaled inverse frequencies (float32, as Hugging Face computes them) of
        a `linear` or `llama3` scaling; YaRN's depend on the rotary base and width
        (`yarn_inv_freq`, which `TransformerConfig.inv_freq` calls)."""
        inv_freq = inv_freq.astype(np.float32)
        factor = np.float32(self.factor)
        if self.kind == "linear":
            return (inv_freq / factor).astype(np.float32)
        if self.kind == "yarn":
            raise ValueError(
                "RopeScaling.apply: a yarn scaling needs the rotary base and width; "
                "call yarn_inv_freq(theta, head_dim) or TransformerConfig.inv_freq()"
            )
        old = np.float32(self.original_max_position)
        low, high = np.float32(self.low_freq_factor), np.float32(self.high_freq_factor)
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters of the decoder: Llama 2/3, Mistral, Qwen2/2.5/3, Gemma 1/2/3, llama2.c.

    One decoder serves every family; the families differ by the switches below, never
    by a copy of the layer code.

    **Arguments:**

    - `vocab_size`, `d_model`, `n_layers`, `n_heads`: the usual sizes.
    - `n_kv_heads`: key/value heads for grouped-query attention (defaults to `n_heads`;
      must divide it).
    - `d_ff`: hidden size of the gated MLP.
    - `max_seq_len`: longest sequence the model is used on (informational; rotary
      embeddings are computed on the fly).
    - `rope_theta`: rotary base frequency.
    - `norm_eps`: RMSNorm epsilon.
    - `tie_embeddings`: the LM head reuses the token embedding matrix.
    - `head_dim`: per-head size (defaults to `d_model // n_heads`).
    - `attn_bias`: biases on the q/k/v projections (Qwen2).
    - `dtype`: parameter dtype, `"float32"` or `"bfloat16"` (or `"float16"`); norms,
      softmax and logits are always accumulated in float32. The step builders train
      float32 and bfloat16 weights; float16 weights serve frozen (a reference model, a
      LoRA base), and a step refuses them as trainable (Adam underflows in float16).
    - `norm_plus_one`: RMSNorm scales by `1 + w` instead of `w` (Gemma); its weights
      start at zero.
    - `mlp_activation`: the gate's activation, `"silu"` (SwiGLU), `"gelu_tanh"`
      (GeGLU with the tanh approximation, Gemma) or `"gelu"` (exact).
    - `embed_scale`: token embeddings are multiplied by `√d_model` (Gemma).
    - `post_norms`: extra RMSNorms on the attention and MLP outputs before the
      residual additions (Gemma 2/3).
    - `qk_norm`: RMSNorm over `head_dim` of every query and key head before rotary
      (Qwen3, Gemma 3).
    - `query_scale`: the attention score scale (default `head_dim ** -0.5`; Gemma 2/3
      use `query_pre_attn_scalar ** -0.5`).
    - `attn_softcap`, `final_softcap`: `c · tanh(x / c)` on the attention scores and
      on the final logits (Gemma 2).
    - `sliding_window`: a query attends to keys at most `sliding_window - 1` positions
      back (Mistral, Gemma 2/3 local layers).
    - `window_layers`: per layer, whether it uses the sliding window (`None`: every
      layer, when `sliding_window` is set). Carried through the layer scan as data.
    - `rope_scaling`: a `RopeScaling` (Llama 3.x `llama3`, `linear`, `yarn`), or `None`.
    - `rope_local_theta`: rotary base of the sliding-window layers, without scaling
      (Gemma 3); `None` uses the global rotary embedding everywhere.
    - `remat`: what the backward pass recomputes of each layer, for less activation
      memory with the same values. `False`: nothing (every activation it reads is kept).
      `True` (or `"full"`): the whole layer from its input (`jax.checkpoint` around the
      scanned layer; least memory, one more forward pass of the layers). `"dots"`: all
      but the outputs of the matrix products (`jax.checkpoint` with the policy
      `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`: the q/k/v, output,
      gate/up and down projections' outputs are kept; the norms, rotary embeddings, the
      MLP activation and the attention are recomputed, which costs far less than the
      products).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    n_kv_heads: int | None = None
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int | None = None
    attn_bias: bool = False
    dtype: str = "float32"
    norm_plus_one: bool = False
    mlp_activation: str = "silu"
    embed_scale: bool = False
    post_norms: bool = False
    qk_norm: bool = False
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] | None = None
    rope_scaling: RopeScaling | None = None
    rope_local_theta: float | None = None
    remat: bool | str = False

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TransformerConfig.{name} must be a positive int, got {value!r}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"TransformerConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}"
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                raise ValueError(
                    f"TransformerConfig.d_model={self.d_model} is not divisible by "
                    f"n_heads={self.n_heads}; pass head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.head_dim % 2 != 0:
            raise ValueError(f"TransformerConfig.head_dim={self.head_dim} must be even (rotary)")
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"TransformerConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if self.remat not in (False, True, "full", "dots"):
            raise ValueError(
                f"TransformerConfig.remat must be False, True, 'full' or 'dots', got {self.remat!r}"
            )
        if self.mlp_activation not in _ACTIVATIONS:
            raise ValueError(
                f"TransformerConfig.mlp_activation must be one of {_ACTIVATIONS}, "
                f"got {self.mlp_activation!r}"
            )
        if not self.rope_theta > 0 or not math.isfinite(self.rope_theta):
            raise ValueError(
                f"TransformerConfig.rope_theta must be a positive number, got {self.rope_theta!r}"
            )
        for name in ("query_scale", "attn_softcap", "final_softcap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(
                    f"TransformerConfig.{name} must be positive or None, got {value!r}"
                )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise ValueError(
                "TransformerConfig.sliding_window must be a positive int or None, "
                f"got {self.sliding_window!r}"
            )
        if self.window_layers is not None:
            object.__setattr__(self, "window_layers", tuple(bool(w) for w in self.window_layers))
            if len(self.window_layers) != self.n_layers:
                raise ValueError(
                    f"TransformerConfig.window_layers has {len(self.window_layers)} entries for "
                    f"n_layers={self.n_layers}"
                )
            if self.sliding_window is None and any(self.window_layers):
                raise ValueError(
                    "TransformerConfig.window_layers marks local layers but sliding_window is None"
                )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                "TransformerConfig.rope_scaling must be a RopeScaling or None, "
                f"got {self.rope_scaling!r}"
            )

    @property
    def param_dtype(self):
        """The jnp dtype of the parameters."""
        return _DTYPES[self.dtype]

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends within the sliding window."""
        if self.sliding_window is None:
            return (False,) * self.n_layers
        return self.window_layers if self.window_layers is not None else (True,) * self.n_layers

    @property
    def norm_init(self) -> float:
        """The RMSNorm weight value of the identity scale (0 with `norm_plus_one`)."""
        return 0.0 if self.norm_plus_one else 1.0

    def inv_freq(self, *, local: bool = False) -> Float32[np.ndarray, " half"]:
        """Rotary inverse frequencies `[head_dim / 2]` (float32), of the local layers with
        `local`."""
        theta = (
            self.rope_local_theta
            if local and self.rope_local_theta is not None
            else self.rope_theta
        )
        exponent = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
            self.head_dim
        )
        inv = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
        rs = self.rope_scaling
        if rs is not None and not (local and self.rope_local_theta is not None):
            if rs.kind == "yarn":
                return rs.yarn_inv_freq(theta, self.head_dim)
            inv = rs.apply(inv)
        return inv

    def rope_attention_factor(self, *, local: bool = False) -> float:
        """The factor the rotary cos / sin tables are multiplied by (YaRN's attention
        factor, `RopeScaling.attention_scale`; 1 without YaRN and on the local layers of
        `rope_local_theta`, which are not scaled)."""
        rs = self.rope_scaling
        if rs is None or (local and self.rope_local_theta is not None):
            return 1.0
        return rs.attention_scale

    def num_params(self) -> int:
        """Number of parameters of a `Policy` with this configuration."""
        D, F, V, L = self.d_model, self.d_ff, self.vocab_size, self.n_layers
        per_layer = D * (self.q_size + 2 * self.kv_size) + self.q_size * D + 3 * D * F + 2 * D
        if self.attn_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.post_norms:
            per_layer += 2 * D
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        head = 0 if self.tie_embeddings else D * V
        return V * D + L * per_layer + D + head

    def flops_per_token(self, seq_len: int) -> int:
        """Forward matmul FLOPs per token at `seq_len` (2·params-in-matmuls + attention)."""
        D, F, V, L = self.d_model, self.d_ff, self.vocab_size, self.n_layers
        proj = D * (self.q_size + 2 * self.kv_size) + self.q_size * D + 3 * D * F
        attn = 2 * self.n_heads * self.head_dim * seq_len  # QK^T and PV, full (unmasked) cost
        return 2 * L * proj + 2 * L * attn + 2 * D * V
