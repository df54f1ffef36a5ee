r"""The geometry of the edges on the CPU: one pass over the edges per direction (numba).

For every edge vector :math:`\vec r_e` (``vec [E, 3]``) :func:`geometry` computes, tile by tile and edges last in
the loops of :mod:`e3attn.kernels.cpu`, what the layer needs of it:

* the spherical harmonics :math:`Y(\hat r_e) = M^T \mu(\hat r_e)` ``[E, (lmax + 1)^2]``, the monomials
  :math:`\mu` built degree by degree (``parents``, ``variables``) and the block-diagonal matrix :math:`M` of
  :class:`~e3attn.spherical_harmonics.SphericalHarmonics` applied per degree, with
  :math:`\hat r = \vec r / \max(r, 10^{-12})` as :func:`torch.nn.functional.normalize`;
* the first layer of the radial networks :math:`p_e = \mathrm{emb}(r_e)\, W_1` ``[E, J]`` on the embedding of
  :class:`~e3attn.radial.RadialEmbedding` (``basis`` 0, 1, 2: ``"smooth_finite"``, ``"gaussian"``,
  ``"bessel"``), which is never stored, per edge over the basis functions that can be nonzero (two of the
  default basis' bumps);
* the lengths :math:`r_e` (the cutoff is left to PyTorch: :math:`r_e = r_\mathrm{max}` must give exactly
  :math:`-\infty`, which needs PyTorch's rounding of :math:`10 (1 - r_e / r_\mathrm{max})`).

Backward (given gradients ``g_sh``), it computes the gradients of
:math:`\langle g_Y, Y \rangle + \langle g_p, p \rangle + \langle g_r, r \rangle` in :math:`\vec r` and
:math:`W_1`, recomputing the tile's geometry (cheaper than storing it). The gradient of :math:`W_1` goes into one
buffer per group (summed in order by the caller: bitwise repeatable). Every
derivative is the one PyTorch's autograd takes of the plain formulation, at the special points too: 0 for the
norm at :math:`r = 0`, :math:`1 / 10^{-12}` for the normalisation below its floor, 0 where a ``torch.where``
selects a constant.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from .cpu import _JIT, _load, _mac, _store

__all__ = ["geometry"]

SMOOTH_FINITE, GAUSSIAN, BESSEL = 0, 1, 2
_EPS = 1e-12  # the floor of torch.nn.functional.normalize
_P = 6  # the polynomial envelope's exponent (e3attn.radial._ENVELOPE_P)


@numba.njit(**_JIT)
def _directions(vt, n, parents, variables, r, u, mono):
    """The tile's lengths ``r``, directions ``u [3, tile]`` and monomials ``mono [monomials, tile]`` of ``u``."""
    for e in range(n):
        x, y, z = vt[0, e], vt[1, e], vt[2, e]
        r[e] = math.sqrt(x * x + y * y + z * z)
        inv = 1.0 / max(r[e], _EPS)
        u[0, e], u[1, e], u[2, e] = x * inv, y * inv, z * inv
    for j in range(1, mono.shape[0]):
        out, first, second = mono[j], mono[parents[j]], u[variables[j]]
        for e in range(n):
            out[e] = first[e] * second[e]


@numba.njit(**_JIT)
def _sinc(t):
    """``sin(t) / t`` and its derivative ``(cos t - sin(t) / t) / t``, by its series where that cancels."""
    if abs(t) > 1e-2:
        s = math.sin(t) / t
        return s, (math.cos(t) - s) / t
    t2 = t * t
    return 1 - t2 * (1 / 6 - t2 / 120), t * (-1 / 3 + t2 * (1 / 30 - t2 / 840))


@numba.njit(inline="always", **_JIT)
def _embedding(r, basis, centers, step, rmax, scale, emb, demb, derivative):
    """The embedding of one length ``r`` (and, if ``derivative``, its derivative): the range ``lo, hi`` of the
    basis functions that may be nonzero, and their values in ``emb[lo:hi]`` (``demb[lo:hi]``); the others are 0.
    Divisions by the step are multiplications by its inverse (a rounding apart: the functions are smooth)."""
    nb, inv_step = centers.shape[0], 1.0 / step
    if not r < rmax:  # every basis function is 0 from r_max on (also for NaN or infinite r: no NaN passes here)
        return 0, 0
    if basis == SMOOTH_FINITE:  # exp(-2 / (1 - d^2)) for |d| < 1: centre k is k + 1 steps out, so k = q - 1 or q
        q = int(r * inv_step)  # (at the others d^2 > 1, or 1 - d^2 is a rounding above 0 and exp(-2 / gap) is 0)
        lo, hi = max(0, q - 1), min(nb, q + 1)
        for k in range(lo, hi):
            d = (r - centers[k]) * inv_step
            gap = 1 - d * d
            if gap > 0:
                t = 1 / gap
                emb[k] = scale * math.exp(-2 * t)
                if derivative:
                    demb[k] = emb[k] * (-4 * d * inv_step) * t * t
            else:
                emb[k] = demb[k] = 0.0
        return lo, hi
    x = r / rmax
    xq = x * x * x * x * x  # x^(p - 1): DimeNet's envelope and its derivative in x (p = 6)
    a, b, c = (_P + 1) * (_P + 2) / 2, _P * (_P + 2), _P * (_P + 1) / 2
    env, denv = 1 - (a - (b - c * x) * x) * xq * x, (-a * _P + (b * (_P + 1) - c * (_P + 2) * x) * x) * xq / rmax
    if basis == BESSEL and x > 1e-2:  # centres 1, ..., n: sin(k theta), cos(k theta) by rotations (k theta > 1e-2)
        theta = math.pi * x
        inv, s1, c1 = 1.0 / theta, math.sin(theta), math.cos(theta)
        sk, ck = s1, c1
        for k in range(nb):  # scale (k + 1) sinc((k + 1) x) env = scale sin(k theta) / theta env, and d/dr
            value = scale * sk * inv
            emb[k] = value * env
            if derivative:
                demb[k] = scale * ((k + 1) * ck - sk * inv) * inv * (math.pi / rmax) * env + value * denv
            sk, ck = sk * c1 + ck * s1, ck * c1 - sk * s1
        return 0, nb
    for k in range(nb):
        ck = centers[k]
        if basis == GAUSSIAN:
            d = (r - ck) * inv_step
            g = scale * math.exp(-d * d)
            emb[k], demb[k] = g * env, g * (denv - 2 * d * inv_step * env)
        else:  # ck sinc(ck r / rmax), sinc(t) = sin(pi t) / (pi t)
            s, ds = _sinc(math.pi * ck * x)
            emb[k], demb[k] = scale * ck * s * env, scale * ck * (ds * math.pi * ck / rmax * env + s * denv)
    return 0, nb


@numba.njit(**_JIT)
def geometry(vec, w1, coef, lmax, basis, centers, step, rmax, scale, parents, variables, g_sh, g_pre, g_r,
             tile, gi, groups, out_sh, out_pre, out_r, out_vec, out_w1):
    """Group ``gi`` of ``groups`` of the tiles. Forward (``g_sh`` empty): ``out_sh [E, (lmax + 1)^2]``,
    ``out_pre [E, J]`` and the lengths ``out_r [E, 1]``. Backward: for the gradients ``g_sh``, ``g_pre`` and
    ``g_r [E, 1]`` of those, the gradients ``out_vec [E, 3]`` (if it has rows) and, added to ``out_w1[gi]``
    ``[nb, J]`` (if it has rows), of :math:`W_1`. (One function for both: numba compiles each function for seconds.)"""
    i1 = np.int64(1)  # not a literal: each literal argument compiles another _mac
    nb, width, nsh, backward = w1.shape[0], w1.shape[1], (lmax + 1) ** 2, g_sh.shape[0] > 0
    nm, dt = (lmax + 1) * (lmax + 2) * (lmax + 3) // 6, vec.dtype
    vt, r, u, gu, emb, demb = np.empty((3, tile), dt), np.empty(tile, dt), np.empty((3, tile), dt), \
        np.empty((3, tile), dt), np.empty(nb, dt), np.empty(nb, dt)
    mono, gmono, sht, grad_r = np.ones((nm, tile), dt), np.empty((nm, tile), dt), np.empty((nsh, tile), dt), \
        np.empty(tile, dt)
    gw = out_w1[gi] if out_w1.shape[0] else np.zeros_like(w1)  # the gradient of W_1, or a scratch
    zero = np.zeros(1, dt)[0]  # sums in the inputs' dtype
    no_index = np.empty(0, np.int64)
    tiles = (vec.shape[0] + tile - 1) // tile
    for ti in range(gi * tiles // groups, (gi + 1) * tiles // groups):
        e0 = ti * tile
        n = min(tile, vec.shape[0] - e0)
        _load(vec, no_index, e0, n, vt)
        _directions(vt, n, parents, variables, r, u, mono)
        vec_grad = backward and out_vec.shape[0] > 0  # (an empty out_vec: no gradient of the vectors wanted)
        if vec_grad:
            _load(g_sh, no_index, e0, n, sht)
        if vec_grad or not backward:  # Y^l = (M^l)^T mu^l or g_mu^l = M^l g_Y^l, block by block (one call site)
            target, source = (gmono, sht) if backward else (sht, mono)
            target[:, :n] = 0.0
            for l in range(lmax + 1):
                m0, size, dim_l = l * (l + 1) * (l + 2) // 6, (l + 1) * (l + 2) // 2, 2 * l + 1
                t0, nt, s0, ns, st, ss = (m0, size, l * l, dim_l, nsh, i1) if backward else (
                    l * l, dim_l, m0, size, i1, nsh)
                _mac(target, t0, nt, source, s0, ns, coef, m0 * nsh + l * l, st, ss, n)
        if not backward:
            _store(sht, e0, n, out_sh)
        for e in range(n):  # p = emb W_1 over the basis functions that are not 0, two rows of W_1 per pass
            lo, hi = _embedding(r[e], basis, centers, step, rmax, scale, emb, demb, backward)
            if not backward:
                out_r[e0 + e, 0] = r[e]
                row = out_pre[e0 + e]
                row[:] = 0.0
                for k in range(lo, hi, 2):
                    k1 = min(k + 1, hi - 1)
                    a, b, wa, wb = emb[k], emb[k1] if k1 > k else zero, w1[k], w1[k1]
                    for j in range(width):
                        row[j] += a * wa[j] + b * wb[j]
                continue
            total, row = g_r[e0 + e, 0], g_pre[e0 + e]  # d/dr of the lengths and the first layer
            for k in range(lo, hi, 2):  # g_emb = W_1 g_p and g_W1 += emb^T g_p
                k1 = min(k + 1, hi - 1)
                a, b = emb[k], emb[k1] if k1 > k else zero
                wa, wb, ga, gb = w1[k], w1[k1], gw[k], gw[k1]
                dot_a = dot_b = zero
                for j in range(width):
                    g = row[j]
                    dot_a += wa[j] * g
                    dot_b += wb[j] * g
                    ga[j] += a * g
                    gb[j] += b * g
                total += demb[k] * dot_a + (demb[k1] * dot_b if k1 > k else zero)
            grad_r[e] = total
        if not vec_grad:
            continue
        gu[:, :n] = 0.0
        for j in range(nm - 1, 0, -1):  # mu_j = mu_parent u_variable, backwards
            gj, gp, mp, uv, guv = gmono[j], gmono[parents[j]], mono[parents[j]], u[variables[j]], gu[variables[j]]
            for e in range(n):
                gp[e] += gj[e] * uv[e]
                guv[e] += gj[e] * mp[e]
        for e in range(n):
            ux, uy, uz, gx, gy, gz = u[0, e], u[1, e], u[2, e], gu[0, e], gu[1, e], gu[2, e]
            if r[e] >= _EPS:  # (g_u - u (u . g_u)) / r + g_r u
                along = ux * gx + uy * gy + uz * gz
                inv = 1.0 / r[e]
                out_vec[e0 + e, 0] = (gx - ux * along) * inv + grad_r[e] * ux
                out_vec[e0 + e, 1] = (gy - uy * along) * inv + grad_r[e] * uy
                out_vec[e0 + e, 2] = (gz - uz * along) * inv + grad_r[e] * uz
            else:  # below the floor u = vec / eps; the norm's gradient is 0 at r = 0
                along = grad_r[e] / r[e] if r[e] > 0 else 0.0 * r[e]
                out_vec[e0 + e, 0] = gx / _EPS + along * vt[0, e]
                out_vec[e0 + e, 1] = gy / _EPS + along * vt[1, e]
                out_vec[e0 + e, 2] = gz / _EPS + along * vt[2, e]
