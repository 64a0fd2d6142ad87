"""One pre-norm decoder block (attention and gated MLP), with optional LoRA adapters on its
projections."""

from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._config import TransformerConfig
from ._layers import Int8Weight, LoRAAdapter, gated_activation, matmul, normal_init, rms_norm
from ._rope import apply_rope

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


class DecoderLayer(eqx.Module):
    """One pre-norm block: RMSNorm → GQA attention (fused q/k/v) → RMSNorm → gated MLP.

    Optional parts, set by the configuration: q/k/v biases (`bqkv`, Qwen2), per-head
    RMSNorm of queries and keys (`q_norm`, `k_norm`, Qwen3 / Gemma 3) and RMSNorms of
    the attention and MLP outputs (`attn_post_norm`, `mlp_post_norm`, Gemma 2/3).
    Inside `Transformer` its array fields carry a leading `n_layers` axis. `lora`, when
    set, maps projection names (`LORA_TARGETS`) to adapters added to that projection's
    output.
    """

    attn_norm: Float[Array, "*L D"]
    wqkv: Array | Int8Weight
    bqkv: Float[Array, "*L QKV"] | None
    q_norm: Float[Array, "*L hd"] | None
    k_norm: Float[Array, "*L hd"] | None
    wo: Array | Int8Weight
    attn_post_norm: Float[Array, "*L D"] | None
    mlp_norm: Float[Array, "*L D"]
    w_gate_up: Array | Int8Weight
    w_down: Array | Int8Weight
    mlp_post_norm: Float[Array, "*L D"] | None
    lora: dict[str, LoRAAdapter] | None

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray, n_layers: int | None = None):
        """One layer, or with `n_layers` a stack of them (every array gets a leading axis)."""
        lead = () if n_layers is None else (n_layers,)
        D, F = cfg.d_model, cfg.d_ff
        dt = cfg.param_dtype
        qkv = cfg.q_size + 2 * cfg.kv_size
        shapes = (lead + (D, qkv), lead + (cfg.q_size, D), lead + (D, 2 * F), lead + (F, D))
        self.wqkv, self.wo, self.w_gate_up, self.w_down = normal_init(
            key, shapes=shapes, scales=(0.02,) * 4, dtype=dt
        )
        norm = lambda n: jnp.full(lead + (n,), cfg.norm_init, dt)
        self.attn_norm = norm(D)
        self.mlp_norm = norm(D)
        self.bqkv = jnp.zeros(lead + (qkv,), dt) if cfg.attn_bias else None
        self.q_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.attn_post_norm = norm(D) if cfg.post_norms else None
        self.mlp_post_norm = norm(D) if cfg.post_norms else None
        self.lora = None

    def _plus_lora(self, name: str, out, x, keys, weight, columns=None, base=None):
        """`out` (the projection `name` of `x`: the output columns `columns` of `x ·
        weight`, plus a bias if any) with its adapter's update added. An adapter that
        reads the base weight (`reads_base`: DoRA) is given the layer's `weight`, the
        `columns` and `base`, the bias-free product of those columns (`out` itself by
        default)."""
        if self.lora is None or name not in self.lora:
            return out
        adapter = self.lora[name]
        key = None if keys is None else keys[LORA_TARGETS.index(name)]
        if getattr(adapter, "reads_base", False):
            columns = (0, weight.shape[-1]) if columns is None else columns
            base = out if base is None else base
            return out + adapter(x, key, weight=weight, columns=columns, base=base)
        return out + adapter(x, key)

    def qkv(self, h: Float[Array, "*B T D"], cfg: TransformerConfig, keys=None):
        """Project to `q [..., T, H, hd]`, `k`, `v [..., T, K, hd]` (before QK-norm and rotary)."""
        lead = h.shape[:-1]
        product = matmul(h, self.wqkv)
        qkv = product
        if self.bqkv is not None:
            qkv = qkv + self.bqkv.astype(qkv.dtype).reshape((1,) * len(lead) + (-1,))
        Q, KV, hd = cfg.q_size, cfg.kv_size, cfg.head_dim
        out = {}
        for name, (lo, hi) in (("q", (0, Q)), ("k", (Q, Q + KV)), ("v", (Q + KV, Q + 2 * KV))):
            out[name] = self._plus_lora(
                name, qkv[..., lo:hi], h, keys, self.wqkv, (lo, hi), product[..., lo:hi]
            )
        return (
            out["q"].reshape(lead + (cfg.n_heads, hd)),
            out["k"].reshape(lead + (cfg.n_kv_heads, hd)),
            out["v"].reshape(lead + (cfg.n_kv_heads, hd)),
        )

    def mlp(
        self, h: Float[Array, "*B T D"], cfg: TransformerConfig, keys=None
    ) -> Float[Array, "*B T D"]:
        """The gated MLP `down(act(gate(h)) · up(h))` of the normalised input `h`."""
        gu = matmul(h, self.w_gate_up)
        F = cfg.d_ff
        gate = self._plus_lora("gate", gu[..., :F], h, keys, self.w_gate_up, (0, F))
        up = self._plus_lora("up", gu[..., F:], h, keys, self.w_gate_up, (F, 2 * F))
        act = gated_activation(gate, up, cfg.mlp_activation)
        return self._plus_lora("down", matmul(act, self.w_down), act, keys, self.w_down)

    def block(
        self,
        x: Float[Array, "*B T D"],
        cfg: TransformerConfig,
        rope: tuple[Float[Array, "*R T hd"], Float[Array, "*R T hd"]],
        attend: Callable,
        keys=None,
        at: Int[Array, "*B N"] | None = None,
    ):
        """The whole block on the residual stream `x`; `attend(q, k, v)` (after rotary)
        returns the attention output `[..., T, H, hd]` and anything to collect.

        With `at`, keys and values come from every position but the queries, the output
        projection and the MLP only from the positions `at` (`[..., N]`): the block
        returns the residual stream `[..., N, D]` there (what a last layer needs when
        only some positions are read out)."""
        norm = lambda y, w: rms_norm(y, w, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        q, k, v = self.qkv(norm(x, self.attn_norm), cfg, keys)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = norm(q, self.q_norm), norm(k, self.k_norm)
        cos, sin = rope
        k = apply_rope(k, cos, sin)
        if at is not None:
            q, cos, sin, x = (gather_positions(a, at) for a in (q, cos, sin, x))
        o, collected = attend(apply_rope(q, cos, sin), k, v)
        o = o.reshape(o.shape[:-2] + (-1,))
        a = self._plus_lora("o", matmul(o, self.wo), o, keys, self.wo)
        if self.attn_post_norm is not None:
            a = norm(a, self.attn_post_norm)
        x = x + a
        m = self.mlp(norm(x, self.mlp_norm), cfg, keys)
        if self.mlp_post_norm is not None:
            m = norm(m, self.mlp_post_norm)
        return x + m, collected


def gather_positions(x: Array, at: Int[Array, "*B N"]) -> Array:
    """`x[..., at, ...]` along the position axis: `x` is `[*B, T, ...]`, the result
    `[*B, N, ...]`."""
    idx = at.reshape(at.shape + (1,) * (x.ndim - at.ndim))
    return jnp.take_along_axis(x, idx, axis=at.ndim - 1)
