"""Configuration of the Llama-family decoder."""

import dataclasses

import jax.numpy as jnp

__all__ = ["TransformerConfig"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, llama2.c).

    **Arguments:**

    - `vocab_size`, `d_model`, `n_layers`, `n_heads`: the usual sizes.
    - `n_kv_heads`: key/value heads for grouped-query attention (defaults to `n_heads`;
      must divide it).
    - `d_ff`: hidden size of the SwiGLU MLP.
    - `max_seq_len`: longest sequence the model is used on (informational; rotary
      embeddings are computed on the fly).
    - `rope_theta`: rotary base frequency.
    - `norm_eps`: RMSNorm epsilon.
    - `tie_embeddings`: the LM head reuses the token embedding matrix.
    - `head_dim`: per-head size (defaults to `d_model // n_heads`).
    - `attn_bias`: biases on the q/k/v projections (Qwen2).
    - `dtype`: parameter dtype, `"float32"` or `"bfloat16"` (or `"float16"`); norms,
      softmax and logits are always accumulated in float32.
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

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
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
            raise ValueError(f"TransformerConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

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

    def num_params(self) -> int:
        """Number of parameters of a `Policy` with this configuration."""
        D, F, V, L = self.d_model, self.d_ff, self.vocab_size, self.n_layers
        per_layer = D * (self.q_size + 2 * self.kv_size) + self.q_size * D + 3 * D * F + 2 * D
        if self.attn_bias:
            per_layer += self.q_size + 2 * self.kv_size
        head = 0 if self.tie_embeddings else D * V
        return V * D + L * per_layer + D + head

    def flops_per_token(self, seq_len: int) -> int:
        """Forward matmul FLOPs per token at `seq_len` (2·params-in-matmuls + attention)."""
        D, F, V, L = self.d_model, self.d_ff, self.vocab_size, self.n_layers
        proj = D * (self.q_size + 2 * self.kv_size) + self.q_size * D + 3 * D * F
        attn = 2 * self.n_heads * self.head_dim * seq_len  # QK^T and PV, full (unmasked) cost
        return 2 * L * proj + 2 * L * attn + 2 * D * V
