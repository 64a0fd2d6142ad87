"""Invariant checks for loss functions: each raises `AssertionError` with a message on failure."""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Shaped

# Junk written into padded positions: extreme and ordinary values of both signs.
DEFAULT_FILL = (-1e4, 3.0, -0.5, 0.0)
# Junk of a second pass: padding may hold NaN or infinities (a fully masked attention row,
# the log of a zero probability), which no finite junk reveals: a loss that multiplies
# padding by 0 instead of selecting it gets `0 * NaN`, as the gradient of
# `jnp.where(mask, x**2, 0)` does at a NaN, which passes `DEFAULT_FILL`.
NONFINITE_FILL = (float("nan"), float("inf"), float("-inf"))


def _is_float_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating)


def _float_leaves(tree: Any) -> list[Array]:
    return [jnp.asarray(x) for x in jax.tree_util.tree_leaves(tree) if _is_float_array(x)]


def _close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=False))


def _sum_of_float_outputs(fn: Callable[..., Any], *args: Any) -> Array:
    leaves = _float_leaves(fn(*args))
    if not leaves:  # only integer / boolean outputs (a mask): nothing to differentiate
        return jnp.zeros(())
    return sum(jnp.sum(leaf) for leaf in leaves)


def _grad_of_sum(fn: Callable[..., Any], argnums: tuple[int, ...], *args: Any) -> tuple:
    return jax.grad(lambda *xs: _sum_of_float_outputs(fn, *xs), argnums=argnums)(*args)


# `fn` and `argnums` are static, so the compiled gradient is reused across calls with the
# same function and shapes (as hypothesis makes them).
_grad_of_sum_jit = jax.jit(_grad_of_sum, static_argnums=(0, 1))


def check_finite(fn: Callable[..., Any], *args: Any, grad: bool = True, jit: bool = True) -> Any:
    """Check that `fn(*args)` and (with `grad`) its gradient are finite.

    Every floating leaf of the output must be free of NaN and inf. With `grad=True` the
    gradient of the sum of all floating output leaves with respect to every floating
    array argument must be finite too (NaN gradients from `jnp.where` over an infinite
    branch are a classic failure that the value alone does not show).

    With `jit=True` (default) `fn` and its gradient are compiled with `jax.jit`, so every
    argument must be an array (use `functools.partial` or a wrapper for the rest).

    **Returns:** `fn(*args)`.
    """
    out = (jax.jit(fn) if jit else fn)(*args)
    for i, leaf in enumerate(_float_leaves(out)):
        bad = ~np.isfinite(np.asarray(leaf))
        assert not bad.any(), f"output leaf {i} is not finite at {np.argwhere(bad).tolist()}"
    if grad:
        argnums = tuple(i for i, a in enumerate(args) if _is_float_array(a))
        if argnums:
            grad_fn = _grad_of_sum_jit if jit else _grad_of_sum
            grads = grad_fn(fn, argnums, *args)
            for i, g in zip(argnums, grads):
                bad = ~np.isfinite(np.asarray(g))
                assert not bad.any(), (
                    f"gradient w.r.t. argument {i} is not finite at {np.argwhere(bad).tolist()}"
                )
    return out


def _junk(x: Array, shape: tuple[int, ...], fill: Sequence[float]) -> np.ndarray:
    """An array of `shape` and `x`'s dtype: `fill` cycled for a float `x`, zeros (masked,
    id 0) for any other."""
    dtype = np.asarray(x).dtype
    if _is_float_array(x):
        return np.resize(np.asarray(fill, np.float64), shape).astype(dtype)
    return np.zeros(shape, dtype)


def _fill_masked(x: Array, mask: Array, fill: Sequence[float]) -> Array:
    """Replace the entries of `x` where `mask` is false by cycling through `fill`."""
    if not _is_float_array(x) or x.shape != mask.shape:
        return x
    return jnp.asarray(np.where(np.asarray(mask), np.asarray(x), _junk(x, x.shape, fill)))


def _pad_last(x: Array, n_pad: int, fill: Sequence[float]) -> Array:
    pad = _junk(x, (*x.shape[:-1], n_pad), fill)
    return jnp.asarray(np.concatenate([np.asarray(x), pad], axis=-1))


def _compare(
    base: Any, other: Any, what: str, rtol: float, atol: float, select: Callable[..., tuple]
) -> None:
    lb = jax.tree_util.tree_leaves(base)
    lo = jax.tree_util.tree_leaves(other)
    assert len(lb) == len(lo), f"{what}: the output structure changed"
    for i, (a, b) in enumerate(zip(lb, lo)):
        a, b = select(np.asarray(a), np.asarray(b))
        assert _close(a, b, rtol, atol), f"{what}: output leaf {i} changed: {a} vs {b}"


def check_padding_invariance(
    fn: Callable[..., Any],
    arrays: Sequence[Shaped[Array, "..."]],
    mask: Bool[Array, "*B T"],
    *,
    n_pad: int = 3,
    fill: Sequence[float] = DEFAULT_FILL,
    nonfinite: bool = False,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    jit: bool = True,
) -> None:
    """Check that masked positions cannot influence `fn(*arrays, mask)`.

    Perturbations of the padding, each of which must leave the output unchanged:

    1. every entry of a float array (same shape as `mask`) at a masked position is
       replaced by junk (`fill`, which includes -1e4);
    2. with `nonfinite=True`, the same with NaN, inf and -inf (`NONFINITE_FILL`): a
       value that multiplies padding by 0 instead of selecting it (`0 * NaN` is NaN)
       fails here, not with finite junk;
    3. `n_pad` masked positions holding junk are appended along the last (sequence) axis
       of every array whose shape is `mask`'s.

    Output leaves with `mask`'s shape (per-token outputs) are compared on the real
    positions only; every other leaf (a scalar loss, per-row values) is compared whole.
    Works for per-sequence functions (`mask: [T]`) and batch functions (`mask: [B, T]`).
    """
    arrays = tuple(arrays)
    T = mask.shape[-1]
    fn = jax.jit(fn) if jit else fn
    base = fn(*arrays, mask)

    mask_np = np.asarray(mask)

    def select_same(a, b):
        if a.shape == mask.shape and b.shape == mask.shape:
            return a[mask_np], b[mask_np]
        return a, b

    altered = tuple(_fill_masked(x, mask, fill) for x in arrays)
    _compare(base, fn(*altered, mask), "junk at masked positions", rtol, atol, select_same)
    if nonfinite:
        altered = tuple(_fill_masked(x, mask, NONFINITE_FILL) for x in arrays)
        what = "NaN / inf at masked positions"
        _compare(base, fn(*altered, mask), what, rtol, atol, select_same)

    padded_mask = _pad_last(mask, n_pad, fill)
    padded = tuple(
        _pad_last(_fill_masked(x, mask, fill), n_pad, fill) if x.shape == mask.shape else x
        for x in arrays
    )

    def select_padded(a, b):
        if a.shape == mask.shape and b.shape == padded_mask.shape:
            return a[mask_np], b[..., :T][mask_np]
        return a, b

    _compare(
        base,
        fn(*padded, padded_mask),
        f"{n_pad} appended masked positions",
        rtol,
        atol,
        select_padded,
    )


def _junk_row(x: Array, fill: Sequence[float]) -> np.ndarray:
    return _junk(x, (1, *x.shape[1:]), fill)


def _set_row(x: Array, i: int, row: np.ndarray) -> Array:
    xn = np.array(x)
    xn[i] = row[0]
    return jnp.asarray(xn)


def check_all_masked_contributes_nothing(
    fn: Callable[..., Any],
    arrays: Sequence[Shaped[Array, "..."]],
    mask: Bool[Array, "B T"],
    *,
    fill: Sequence[float] = DEFAULT_FILL,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    jit: bool = True,
) -> None:
    """Check that a fully-masked row of a batch contributes nothing to `fn(*arrays, mask)`.

    `fn` is a batch function (leading axis `B` on every array and on `mask`). Checked:

    1. appending a fully-masked row of junk leaves the output unchanged;
    2. masking out row `i` entirely (and filling it with junk) gives the same output as
       removing row `i` from the batch (for every `i`, when `B > 1`).

    Output leaves whose leading axis is the batch axis (per-row values) are compared
    without the affected row; other leaves (scalars) are compared whole.
    """
    arrays = tuple(arrays)
    B = mask.shape[0]
    fn = jax.jit(fn) if jit else fn
    base = fn(*arrays, mask)

    ext = tuple(
        jnp.asarray(np.concatenate([np.asarray(x), _junk_row(x, fill)], axis=0)) for x in arrays
    )
    ext_mask = jnp.asarray(
        np.concatenate([np.asarray(mask), np.zeros((1, *mask.shape[1:]), bool)], axis=0)
    )

    def select_ext(a, b):
        if a.ndim >= 1 and a.shape[0] == B and b.ndim >= 1 and b.shape[0] == B + 1:
            return a, b[:B]
        return a, b

    _compare(base, fn(*ext, ext_mask), "appended fully-masked row", rtol, atol, select_ext)

    if B < 2:
        return
    for i in range(B):
        keep = np.arange(B) != i
        row_off = _set_row(mask, i, np.zeros((1, *mask.shape[1:]), bool))
        masked = tuple(
            _set_row(x, i, _junk_row(x, fill)) if _is_float_array(x) else x for x in arrays
        )
        removed = fn(
            *(jnp.asarray(np.asarray(x)[keep]) for x in arrays), jnp.asarray(np.asarray(mask)[keep])
        )

        def select_row(a, b, keep=keep):
            if a.ndim >= 1 and a.shape[0] == B and b.ndim >= 1 and b.shape[0] == B - 1:
                return a[keep], b
            return a, b

        _compare(
            fn(*masked, row_off),
            removed,
            f"row {i} fully masked vs removed",
            rtol,
            atol,
            select_row,
        )


def check_permutation_invariance(
    fn: Callable[..., Any],
    arrays: Sequence[Shaped[Array, "..."]],
    *,
    permute_outputs: bool = True,
    n_permutations: int = 3,
    seed: int = 0,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    jit: bool = True,
) -> None:
    """Check that permuting the batch permutes (or leaves unchanged) `fn(*arrays)`.

    Every array is permuted jointly along its leading (batch) axis. With
    `permute_outputs=True` output leaves whose leading axis has the batch size must come
    out permuted the same way (per-example losses), and other leaves (scalar
    reductions) unchanged. With `permute_outputs=False` every leaf must be unchanged
    (e.g. rank-ordered outputs such as the AOT losses).
    """
    arrays = tuple(arrays)
    B = arrays[0].shape[0]
    fn = jax.jit(fn) if jit else fn
    base = fn(*arrays)
    rng = np.random.default_rng(seed)
    perms = [np.arange(B)[::-1]] + [rng.permutation(B) for _ in range(n_permutations - 1)]
    for perm in perms:
        out = fn(*(jnp.asarray(np.asarray(x)[perm]) for x in arrays))

        def select(a, b, perm=perm):
            if permute_outputs and a.ndim >= 1 and a.shape[0] == B:
                return a[perm], b
            return a, b

        _compare(base, out, f"batch permutation {perm.tolist()}", rtol, atol, select)


def _clip_grad(loss_fn: Callable[..., Any], logp: Array, *rest: Any) -> Array:
    def total(lp):
        out = loss_fn(lp, *rest)
        if isinstance(out, tuple):
            out = out[0]
        return jnp.sum(out)

    return jax.grad(total)(logp)


_clip_grad_jit = jax.jit(_clip_grad, static_argnums=0)


def check_ppo_clip_gradient_zero(
    loss_fn: Callable[..., Any],
    logp: Float[Array, "*B T"],
    old_logp: Float[Array, "*B T"],
    advantages: Float[ArrayLike, "..."],
    mask: Bool[Array, "*B T"],
    *,
    clip_eps: float | int = 0.2,
    clip_eps_high: float | int | None = None,
    margin: float | int = 1e-3,
    check_inside: bool = True,
) -> None:
    r"""Check the gradient pattern of a clipped (PPO / GRPO token-level) policy loss.

    `loss_fn(logp, old_logp, advantages, mask)` returns per-token losses, a scalar, or a
    tuple whose first element is one of those (as `ppo_policy_loss`); its sum is
    differentiated with respect to `logp`. With $\rho_t = \exp(\log\pi - \log\pi_{\rm old})$:

    - where the ratio has left the clip region in the direction the advantage pushes it
      ($A_t > 0,\ \rho_t > 1+\varepsilon_{\rm high}$ or
      $A_t < 0,\ \rho_t < 1-\varepsilon_{\rm low}$),
      the gradient must be exactly 0;
    - at masked positions the gradient must be exactly 0;
    - with `check_inside`, at real positions strictly inside the clip region with
      $|A_t| > 10^{-6}$ the gradient must be non-zero (so a loss that never passes
      gradient cannot pass the check).

    `margin` keeps positions within a relative `margin` of the clip boundaries out of
    both checks. `advantages` may be per-token or a per-sequence scalar (broadcast).
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    g = np.asarray(_clip_grad_jit(loss_fn, logp, old_logp, advantages, mask))
    adv = np.asarray(advantages, np.float64)
    if adv.shape != logp.shape:
        adv = np.broadcast_to(adv.reshape(adv.shape + (1,) * (logp.ndim - adv.ndim)), logp.shape)
    m = np.asarray(mask)
    ratio = np.exp(np.asarray(logp, np.float64) - np.asarray(old_logp, np.float64))
    hi = (1.0 + eps_high) * (1.0 + margin)
    lo = (1.0 - clip_eps) * (1.0 - margin)
    outside = m & (((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo)))
    assert np.all(g[outside] == 0.0), (
        "non-zero gradient where the ratio is clipped: positions "
        f"{np.argwhere(outside & (g != 0)).tolist()}"
    )
    assert np.all(g[~m] == 0.0), (
        f"non-zero gradient at masked positions {np.argwhere(~m & (g != 0)).tolist()}"
    )
    if check_inside:
        inside_lo = (1.0 - clip_eps) * (1.0 + margin)
        inside_hi = (1.0 + eps_high) * (1.0 - margin)
        inside = m & (np.abs(adv) > 1e-6) & (ratio > inside_lo) & (ratio < inside_hi)
        assert np.all(g[inside] != 0.0), (
            f"zero gradient inside the clip region at {np.argwhere(inside & (g == 0)).tolist()}"
        )


def check_masked_gradients_zero(
    fn: Callable[..., Any],
    arrays: Sequence[Shaped[Array, "..."]],
    mask: Bool[Array, "*B T"],
    *,
    fill: Sequence[float] = DEFAULT_FILL,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    jit: bool = True,
    nonfinite: bool = False,
) -> None:
    """Check that masked positions receive no gradient and do not change the others.

    The gradient of the sum of every floating output leaf of `fn(*arrays, mask)` is taken
    with respect to each float array of `mask`'s shape. Checked:

    1. it is exactly 0 at every masked position (a masked token must not be trained);
    2. replacing the masked entries by junk (`fill`, which includes -1e4) leaves the
       gradient at the real positions unchanged, and still exactly 0 at the masked ones;
    3. with `nonfinite=True`, the same with NaN, inf and -inf as the junk
       (`NONFINITE_FILL`): `jnp.where(mask, x**2, 0)` fails here (its gradient at a NaN
       is `0 * NaN`), and so does any function of the padding taken before the mask
       selects it (`jnp.where(mask, kl_penalty(logp, ref_logp), 0)`), not with finite
       junk.

    `check_padding_invariance` checks the values; this checks what training sees.
    """
    arrays = tuple(arrays)
    argnums = tuple(i for i, x in enumerate(arrays) if _is_float_array(x) and x.shape == mask.shape)
    if not argnums:
        return
    grad_fn = _grad_of_sum_jit if jit else _grad_of_sum
    m = np.asarray(mask)
    base = grad_fn(fn, argnums, *arrays, mask)
    fills = [("junk", fill)] + ([("NaN / inf", NONFINITE_FILL)] if nonfinite else [])
    for i, g in zip(argnums, base):
        g = np.asarray(g)
        assert np.all(g[~m] == 0.0), (
            f"gradient w.r.t. argument {i} is non-zero at masked positions "
            f"{np.argwhere(~m & (g != 0)).tolist()}"
        )
    for junk, values in fills:
        altered = tuple(_fill_masked(x, mask, values) for x in arrays)
        other = grad_fn(fn, argnums, *altered, mask)
        for i, g, h in zip(argnums, base, other):
            g, h = np.asarray(g), np.asarray(h)
            assert np.all(h[~m] == 0.0), (
                f"gradient w.r.t. argument {i} after {junk} at masked positions is non-zero "
                f"at masked positions {np.argwhere(~m & (h != 0)).tolist()}"
            )
            assert _close(g[m], h[m], rtol, atol), (
                f"gradient w.r.t. argument {i} at real positions changed with the {junk} at "
                f"masked positions: {g[m]} vs {h[m]}"
            )
