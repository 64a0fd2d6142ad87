"""The Llama-family decoder: a stack of pre-norm blocks applied with `jax.lax.scan`.

The model is written for one sequence (no batch axis); batch it with `jax.vmap`.
Positions come from the mask (the `t`-th real token of a segment gets position
`t`), so left padding, right padding and padding between a prompt and its completion
all give the same outputs at real positions. Projections are fused (`wqkv`,
`w_gate_up`) and the KV cache is head-major (`[L, K, S, hd]`) and updated in place.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._config import TransformerConfig
from ._protocols import AbstractBatchedModel, AbstractSequenceModel
from ._layers import (
    Int8Weight,
    LoRAAdapter,
    apply_rope,
    attention,
    matmul,
    normal_init,
    rms_norm,
    rope_tables,
)

__all__ = ["DecoderLayer", "Transformer", "KVCache", "LORA_TARGETS"]

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


class KVCache(eqx.Module):
    """Per-sequence key/value cache, head-major: `k[l, h, s]` is layer `l`, kv head `h`, slot `s`.

    `mask[s]` says whether slot `s` holds a real token that later tokens may attend to.
    """

    k: Float[Array, "L K S hd"]
    v: Float[Array, "L K S hd"]
    mask: Bool[Array, " S"]


class DecoderLayer(eqx.Module):
    """One pre-norm block: RMSNorm → GQA attention (fused q/k/v) → RMSNorm → SwiGLU MLP.

    Inside `Transformer` its array fields carry a leading `n_layers` axis.
    `lora`, when set, maps projection names (`LORA_TARGETS`) to adapters added to that
    projection's output.
    """

    attn_norm: Float[Array, "*L D"]
    wqkv: Array | Int8Weight
    bqkv: Float[Array, "*L QKV"] | None
    wo: Array | Int8Weight
    mlp_norm: Float[Array, "*L D"]
    w_gate_up: Array | Int8Weight
    w_down: Array | Int8Weight
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
        self.attn_norm = jnp.ones(lead + (D,), dt)
        self.bqkv = jnp.zeros(lead + (qkv,), dt) if cfg.attn_bias else None
        self.mlp_norm = jnp.ones(lead + (D,), dt)
        self.lora = None

    def _lora(self, name: str, x, keys):
        if self.lora is None or name not in self.lora:
            return None
        key = None if keys is None else keys[LORA_TARGETS.index(name)]
        return self.lora[name](x, key)

    def qkv(self, h: Float[Array, "*B T D"], cfg: TransformerConfig, keys=None):
        """Project to `q [..., T, H, hd]`, `k`, `v [..., T, K, hd]` (before rotary)."""
        lead = h.shape[:-1]
        qkv = matmul(h, self.wqkv)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv.astype(qkv.dtype).reshape((1,) * len(lead) + (-1,))
        q = qkv[..., : cfg.q_size]
        k = qkv[..., cfg.q_size : cfg.q_size + cfg.kv_size]
        v = qkv[..., cfg.q_size + cfg.kv_size :]
        for name, part in (("q", q), ("k", k), ("v", v)):
            delta = self._lora(name, h, keys)
            if delta is not None:
                if name == "q":
                    q = part + delta
                elif name == "k":
                    k = part + delta
                else:
                    v = part + delta
        hd = cfg.head_dim
        return (
            q.reshape(lead + (cfg.n_heads, hd)),
            k.reshape(lead + (cfg.n_kv_heads, hd)),
            v.reshape(lead + (cfg.n_kv_heads, hd)),
        )

    def attn_out(self, o: Float[Array, "*B T Q"], keys=None) -> Float[Array, "*B T D"]:
        out = matmul(o, self.wo)
        delta = self._lora("o", o, keys)
        return out if delta is None else out + delta

    def mlp(self, x: Float[Array, "*B T D"], cfg: TransformerConfig, keys=None) -> Float[Array, "*B T D"]:
        h = rms_norm(x, self.mlp_norm, cfg.norm_eps)
        gu = matmul(h, self.w_gate_up)
        gate, up = gu[..., : cfg.d_ff], gu[..., cfg.d_ff :]
        dg, du = self._lora("gate", h, keys), self._lora("up", h, keys)
        if dg is not None:
            gate = gate + dg
        if du is not None:
            up = up + du
        act = jax.nn.silu(gate) * up
        out = matmul(act, self.w_down)
        dd = self._lora("down", act, keys)
        return out if dd is None else out + dd


def _layer_keys(key: PRNGKeyArray | None, n_layers: int):
    if key is None:
        return None
    return jax.random.split(key, (n_layers, len(LORA_TARGETS)))


class Transformer(AbstractSequenceModel, AbstractBatchedModel):
    """Token embedding, `n_layers` stacked `DecoderLayer`s (scanned), final RMSNorm.

    `__call__(tokens, mask)` returns the final hidden states `[T, D]`.
    """

    embed: Float[Array, "V D"]
    layers: DecoderLayer
    final_norm: Float[Array, " D"]
    cfg: TransformerConfig = eqx.field(static=True)

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
        ke, kl = jax.random.split(key)
        self.cfg = cfg
        dt = cfg.param_dtype
        (self.embed,) = normal_init(ke, shapes=((cfg.vocab_size, cfg.d_model),), scales=(0.02,), dtype=dt)
        self.layers = DecoderLayer(cfg, key=kl, n_layers=cfg.n_layers)
        self.final_norm = jnp.ones((cfg.d_model,), dt)

    def _embed(self, tokens: Int[Array, "*B T"]) -> Float[Array, "*B T D"]:
        return jnp.take(self.embed, tokens, axis=0)

    def _scan(self, x, allowed, positions, key, collect_kv: bool):
        cfg = self.cfg
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        keys = _layer_keys(key, cfg.n_layers)

        def body(x, xs):
            layer_dyn, lkeys = xs
            layer = eqx.combine(layer_dyn, static)
            h = rms_norm(x, layer.attn_norm, cfg.norm_eps)
            q, k, v = layer.qkv(h, cfg, lkeys)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kh, vh = jnp.swapaxes(k, -3, -2), jnp.swapaxes(v, -3, -2)
            o = attention(q, kh, vh, allowed)
            x = x + layer.attn_out(o.reshape(o.shape[:-2] + (-1,)), lkeys)
            x = x + layer.mlp(x, cfg, lkeys)
            return x, ((kh, vh) if collect_kv else None)

        x, kv = jax.lax.scan(body, x, (dynamic, keys))
        return rms_norm(x, self.final_norm, cfg.norm_eps), kv

    def __call__(
        self,
        tokens: Int[Array, "*B T"],
        mask: Bool[Array, "*B T"],
        *,
        segment_ids: Int[Array, "*B T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*B T D"]:
        """Hidden states for one sequence (or a batch: any leading axes, same result as `jax.vmap`).

        **Arguments:**

        - `tokens`, `mask`: token ids and which of them are real.
        - `segment_ids`: optional packing ids; tokens attend only within their segment
          and positions restart at 0 in each segment.
        - `key`: enables LoRA dropout when adapters are attached (training); `None`
          is deterministic.
        """
        allowed, positions = _attention_layout(mask, segment_ids)
        h, _ = self._scan(self._embed(tokens), allowed, positions, key, collect_kv=False)
        return h

    def prefill(
        self, tokens: Int[Array, " P"], mask: Bool[Array, " P"], *, cache_size: int
    ) -> tuple[Float[Array, "P D"], KVCache]:
        """Run the prompt and return its hidden states and a cache with `cache_size` slots."""
        P = tokens.shape[0]
        if cache_size < P:
            raise ValueError(f"cache_size={cache_size} is smaller than the prompt length {P}")
        allowed, positions = _attention_layout(mask, None)
        h, (k, v) = self._scan(self._embed(tokens), allowed, positions, None, collect_kv=True)
        pad = [(0, 0), (0, 0), (0, cache_size - P), (0, 0)]
        cache = KVCache(
            k=jnp.pad(k, pad),
            v=jnp.pad(v, pad),
            mask=jnp.concatenate([mask, jnp.zeros((cache_size - P,), jnp.bool_)]),
        )
        return h, cache

    def decode_step(
        self,
        token: Int[Array, ""],
        cache: KVCache,
        *,
        index: Int[Array, ""] | int,
        position: Int[Array, ""],
    ) -> tuple[Float[Array, " D"], KVCache]:
        """Feed one token at cache slot `index` with rotary position `position`.

        The token attends to every valid slot and to itself; its keys and values are
        written into the cache in place (`dynamic_update_slice` inside the layer scan).
        """
        cfg = self.cfg
        index = jnp.asarray(index, jnp.int32)
        x = self._embed(token[None])
        cos, sin = rope_tables(position[None], cfg.head_dim, cfg.rope_theta)
        slot_mask = cache.mask.at[index].set(True)
        allowed = slot_mask[None, :]
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        zero = jnp.zeros((), jnp.int32)

        def body(carry, xs):
            x, kc, vc = carry
            layer_dyn, l = xs
            layer = eqx.combine(layer_dyn, static)
            h = rms_norm(x, layer.attn_norm, cfg.norm_eps)
            q, k, v = layer.qkv(h, cfg)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            start = (l, zero, index, zero)
            kc = jax.lax.dynamic_update_slice(kc, jnp.swapaxes(k, 0, 1)[None].astype(kc.dtype), start)
            vc = jax.lax.dynamic_update_slice(vc, jnp.swapaxes(v, 0, 1)[None].astype(vc.dtype), start)
            o = attention(q, kc[l], vc[l], allowed)
            x = x + layer.attn_out(o.reshape(1, -1))
            x = x + layer.mlp(x, cfg)
            return (x, kc, vc), None

        layer_ids = jnp.arange(cfg.n_layers, dtype=jnp.int32)
        (x, kc, vc), _ = jax.lax.scan(body, (x, cache.k, cache.v), (dynamic, layer_ids))
        h = rms_norm(x, self.final_norm, cfg.norm_eps)
        return h[0], KVCache(k=kc, v=vc, mask=slot_mask)


def _attention_layout(
    mask: Bool[Array, "*B T"], segment_ids: Int[Array, "*B T"] | None
) -> tuple[Bool[Array, "*B T T"], Int[Array, "*B T"]]:
    """Which keys each query may attend to, and each token's rotary position.

    Causal, real keys only, same segment only. A token's position is the number of
    real keys it may attend to before itself, so padding never shifts positions.
    """
    T = mask.shape[-1]
    causal = jnp.asarray(np.tril(np.ones((T, T), dtype=bool)))
    allowed = causal.reshape((1,) * (mask.ndim - 1) + (T, T)) & mask[..., None, :]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[..., :, None] == segment_ids[..., None, :])
    positions = jnp.maximum(jnp.sum(allowed, axis=-1, dtype=jnp.int32) - 1, 0)
    return allowed, positions
