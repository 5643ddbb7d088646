"""Fault operators: deadzone, noise kinds, noisy linear, against hand-computed numbers."""

import functools
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from aqn_jax.faults import ops

# amax = 2.0, so tensor granularity at threshold 0.01 gives thr = 0.02.
X_HAND = np.array([[0.5, -0.004, 2.0], [0.019, -1.0, 0.021]], np.float32)


def _plain_linear(x, w, b):
    """The model's Linear expression, differentiated by plain autodiff."""
    y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return y if b is None else y + b.astype(x.dtype)


class DeadzoneTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_tensor_granularity(self):
        # amax over the whole tensor = 2.0 -> thr = 0.01 * 2.0 = 0.02.
        # |-0.004| < 0.02 and |0.019| < 0.02 flush; 0.021 survives (strict <).
        fn = self.variant(lambda x, t: ops.deadzone(x, t, granularity="tensor"))
        out = fn(X_HAND, 0.01)
        expected = np.array([[0.5, 0.0, 2.0], [0.0, -1.0, 0.021]], np.float32)
        np.testing.assert_array_equal(out, expected)
        thr = ops.deadzone_threshold(X_HAND, 0.01, granularity="tensor")
        np.testing.assert_allclose(np.broadcast_to(thr, X_HAND.shape), 0.02, rtol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_token_granularity_differs_from_tensor(self):
        # Row 0: amax 2.0 -> thr 0.02 -> -0.004 flushes.
        # Row 1: amax 1.0 -> thr 0.01 -> 0.019 and 0.021 both survive (tensor flushed 0.019).
        fn = self.variant(lambda x, t: ops.deadzone(x, t, granularity="token"))
        out = fn(X_HAND, 0.01)
        expected = np.array([[0.5, 0.0, 2.0], [0.019, -1.0, 0.021]], np.float32)
        np.testing.assert_array_equal(out, expected)
        thr = ops.deadzone_threshold(X_HAND, 0.01, granularity="token")
        np.testing.assert_allclose(thr, [[0.02], [0.01]], rtol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_block_granularity_differs_from_tensor(self):
        x = np.array([[4.0, 0.03, -0.05, 1.0, 0.2, 0.001, -0.003, 0.01]], np.float32)
        # tensor: amax 4.0 -> thr 0.04 -> 0.03, 0.001, -0.003, 0.01 flush.
        tensor = ops.deadzone(x, 0.01, granularity="tensor")
        np.testing.assert_array_equal(
            tensor, np.float32([[4.0, 0.0, -0.05, 1.0, 0.2, 0.0, 0.0, 0.0]])
        )
        # block 4: block 0 amax 4.0 -> thr 0.04 -> 0.03 flushes;
        #          block 1 amax 0.2 -> thr 0.002 -> only 0.001 flushes.
        fn = self.variant(lambda x, t: ops.deadzone(x, t, granularity="block", block_size=4))
        out = fn(x, 0.01)
        np.testing.assert_array_equal(
            out, np.float32([[4.0, 0.0, -0.05, 1.0, 0.2, 0.0, -0.003, 0.01]])
        )
        thr = ops.deadzone_threshold(x, 0.01, granularity="block", block_size=4)
        np.testing.assert_allclose(thr, [[0.04] * 4 + [0.002] * 4], rtol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_sparsity_mask_restricts_flushing_to_masked_lanes(self):
        # thr 0.02 as in test_tensor_granularity; lanes 0 and 2 are faulty, lane 1 is healthy:
        # -0.004 (lane 1) survives, 0.019 (lane 0) flushes, 0.021 (lane 2) is above thr.
        lanes = np.array([True, False, True])
        fn = self.variant(lambda x, t: ops.deadzone(x, t, sparsity_mask=lanes))
        out = fn(X_HAND, 0.01)
        np.testing.assert_array_equal(out, np.float32([[0.5, -0.004, 2.0], [0.0, -1.0, 0.021]]))
        flush = ops.deadzone_flush_mask(X_HAND, 0.01, sparsity_mask=lanes)
        np.testing.assert_array_equal(flush, [[False, False, False], [True, False, False]])

    def test_tensor_granularity_is_batch_dependent_token_is_not(self):
        row = X_HAND[1:]  # [0.019, -1.0, 0.021]
        # Alone: amax 1.0 -> thr 0.01 -> nothing flushes.
        np.testing.assert_array_equal(ops.deadzone(row, 0.01, granularity="tensor"), row)
        # Batched with a row of amax 2.0: thr 0.02 -> the same 0.019 now flushes.
        batched = ops.deadzone(X_HAND, 0.01, granularity="tensor")
        np.testing.assert_array_equal(batched[1], np.float32([0.0, -1.0, 0.021]))
        # Token granularity: the row gives the same answer alone and in the batch.
        alone = ops.deadzone(row, 0.01, granularity="token")
        batched = ops.deadzone(X_HAND, 0.01, granularity="token")
        np.testing.assert_array_equal(alone[0], row[0])
        np.testing.assert_array_equal(batched[1], row[0])

    def test_bfloat16_keeps_dtype_and_exact_zeros(self):
        x = jnp.asarray(X_HAND, jnp.bfloat16)
        out = ops.deadzone(x, 0.01)
        self.assertEqual(out.dtype, jnp.bfloat16)
        # bf16(0.019) = 0.01904296875 < 0.02 and bf16(0.021) = 0.02099609375 > 0.02.
        np.testing.assert_array_equal(
            np.asarray(out, np.float32), np.float32([[0.5, 0.0, 2.0], [0.0, -1.0, 0.02099609375]])
        )
        self.assertEqual(int(jnp.sum(out == 0)), 2)

    @chex.variants(with_jit=True, without_jit=True)
    def test_mask_gradient_is_zero_exactly_where_flushed(self):
        # Flushed: (0, 1) and (1, 0) (see test_tensor_granularity); d sum / dx = 1 elsewhere.
        fn = self.variant(jax.grad(lambda x, t: jnp.sum(ops.deadzone(x, t, grad="mask"))))
        g = fn(jnp.asarray(X_HAND), 0.01)
        np.testing.assert_array_equal(g, [[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_ste_gradient_is_identity(self):
        fn = self.variant(jax.grad(lambda x, t: jnp.sum(ops.deadzone(x, t, grad="ste"))))
        g = fn(jnp.asarray(X_HAND), 0.01)
        np.testing.assert_array_equal(g, np.ones((2, 3), np.float32))

    def test_threshold_gets_zero_gradient(self):
        g = jax.grad(lambda t: jnp.sum(ops.deadzone(jnp.asarray(X_HAND), t)))(0.01)
        self.assertEqual(float(g), 0.0)

    def test_new_threshold_does_not_retrace(self):
        traces = []

        @jax.jit
        def f(x, t):
            traces.append(1)
            return ops.deadzone(x, t)

        # thr 0.02 flushes 2 values; thr 0.04 also flushes 0.021 (3 values).
        self.assertEqual(int(jnp.sum(f(X_HAND, 0.01) == 0)), 2)
        self.assertEqual(int(jnp.sum(f(X_HAND, 0.02) == 0)), 3)
        self.assertEqual(len(traces), 1)


class QuantileDeadzoneTest(chex.TestCase):
    """severity='quantile': flush the q smallest |x| (k = floor(q * n) of each set of n)."""

    # |x| ranked: 0.004 < 0.019 < 0.021 < 0.5 < 1.0 < 2.0 (tensor, n = 6).
    @chex.variants(with_jit=True, without_jit=True)
    def test_tensor(self):
        fn = self.variant(lambda x, q: ops.deadzone(x, q, severity="quantile"))
        # q = 0.5: k = 3, thr = the 4th smallest |x| = 0.5 -> -0.004, 0.019, 0.021 flush.
        out = fn(X_HAND, 0.5)
        np.testing.assert_array_equal(out, np.float32([[0.5, 0.0, 2.0], [0.0, -1.0, 0.0]]))
        # q = 0.34: k = floor(2.04) = 2 -> the two smallest (-0.004, 0.019) flush.
        out = fn(X_HAND, 0.34)
        np.testing.assert_array_equal(out, np.float32([[0.5, 0.0, 2.0], [0.0, -1.0, 0.021]]))
        # q = 0.1: k = 0 -> nothing flushes (the negative control of the count).
        np.testing.assert_array_equal(fn(X_HAND, 0.1), X_HAND)
        thr = ops.deadzone_threshold(X_HAND, 0.5, severity="quantile")
        np.testing.assert_array_equal(np.broadcast_to(thr, X_HAND.shape), 0.5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_token(self):
        fn = self.variant(lambda x, q: ops.deadzone(x, q, granularity="token", severity="quantile"))
        # Per row of n = 3, q = 0.67: k = floor(2.01) = 2 -> each row's two smallest |x| flush.
        # Row 0: |.| = 0.5, 0.004, 2.0 -> 0.5 and -0.004 flush; row 1: 0.019 and 0.021 flush.
        out = fn(X_HAND, 0.67)
        np.testing.assert_array_equal(out, np.float32([[0.0, 0.0, 2.0], [0.0, -1.0, 0.0]]))
        thr = ops.deadzone_threshold(X_HAND, 0.67, granularity="token", severity="quantile")
        np.testing.assert_array_equal(thr, [[2.0], [1.0]])
        # q = 0.5: k = 1 per row -> -0.004 and 0.019; tensor-wide (k = 3) 0.021 flushes too.
        out = fn(X_HAND, 0.5)
        np.testing.assert_array_equal(out, np.float32([[0.5, 0.0, 2.0], [0.0, -1.0, 0.021]]))

    @chex.variants(with_jit=True, without_jit=True)
    def test_flushed_fraction_and_mask_gradient(self):
        x = jax.random.normal(jax.random.PRNGKey(0), (4, 50, 64))
        # One function (q traced under jit): one program for the three quantiles.
        flush_mask = self.variant(lambda x, q: ops.deadzone_flush_mask(x, q, severity="quantile"))
        for q in (0.1, 0.5, 0.96):
            flush = flush_mask(x, q)
            self.assertEqual(int(jnp.sum(flush)), int(np.floor(q * x.size)))
        # The mask gradient is 0 exactly where a value flushed (q = 0.5 of X_HAND, above).
        g = self.variant(
            jax.grad(lambda x, q: jnp.sum(ops.deadzone(x, q, severity="quantile", grad="mask")))
        )(jnp.asarray(X_HAND), 0.5)
        np.testing.assert_array_equal(g, [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])

    def test_kth_smallest_is_the_sorts_element_bit_for_bit(self):
        # The bit-pattern search against jnp.sort, every k of each row: ties, zeros (+0 and
        # the |.| of -0), denormals, huge values, +inf and NaN (ranked last, as sort does).
        rng = np.random.default_rng(0)
        rows = [
            np.abs(rng.standard_normal(37)).astype(np.float32),
            np.float32([0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 0.5, 0.5]),
            np.abs(np.float32([-0.0, 1e-45, 3e-39, 1e38, np.inf, np.nan, 7.0, 1e-45])),
            np.abs(rng.standard_normal(5) * 1e4).astype(np.float32),
        ]
        kth = jax.jit(ops.kth_smallest_nonneg)
        for row in rows:
            ranked = np.sort(row)
            for k in range(row.size):
                got = np.asarray(kth(row[None], k))[0, 0]
                np.testing.assert_array_equal(
                    np.float32(got).view(np.int32), ranked[k].view(np.int32), err_msg=f"{row} {k}"
                )
        # Per row of a [..., D] array, k broadcast over the rows: each row's own k-th.
        x = np.abs(rng.standard_normal((3, 4, 16))).astype(np.float32)
        got = np.asarray(kth(x, 5))
        np.testing.assert_array_equal(got, np.sort(x, axis=-1)[..., 5:6])
        # Negative control: a different k gives a different value.
        self.assertFalse(np.array_equal(got, np.asarray(kth(x, 6))))

    def test_traced_quantile_does_not_retrace(self):
        traces = []

        @jax.jit
        def f(x, q):
            traces.append(1)
            return ops.deadzone(x, q, severity="quantile")

        self.assertEqual(int(jnp.sum(f(X_HAND, 0.5) == 0)), 3)
        self.assertEqual(int(jnp.sum(f(X_HAND, 0.0) == 0)), 0)  # q * (0/1 layer factor) = 0
        self.assertEqual(len(traces), 1)

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match=r"severity='median' is not supported"):
            ops.deadzone(X_HAND, 0.5, severity="median")
        with pytest.raises(ValueError, match=r"threshold=1.0: a quantile deadzone needs"):
            ops.deadzone(X_HAND, 1.0, severity="quantile")
        with pytest.raises(ValueError, match=r"takes granularity 'tensor' or 'token'"):
            ops.deadzone(X_HAND, 0.5, severity="quantile", granularity="block", block_size=3)


class SparsityMaskTest(parameterized.TestCase):
    def test_positions_from_numpy_permutation(self):
        # round(0.25 * 10) = round(2.5) = 2 (half to even): the first 2 entries of the permutation.
        mask = ops.make_sparsity_mask(seed=3, size=10, fraction=0.25)
        perm = np.random.default_rng(3).permutation(10)
        expected = np.zeros(10, bool)
        expected[perm[:2]] = True
        np.testing.assert_array_equal(mask, expected)
        self.assertEqual(mask.dtype, np.bool_)
        self.assertEqual(int(mask.sum()), 2)

    @parameterized.parameters((0.0, 0), (0.3, 30), (1.0, 100))
    def test_count(self, fraction, count):
        self.assertEqual(int(ops.make_sparsity_mask(0, 100, fraction).sum()), count)

    def test_seed_matters(self):
        a = ops.make_sparsity_mask(0, 100, 0.5)
        b = ops.make_sparsity_mask(1, 100, 0.5)
        self.assertGreater(int(np.sum(a != b)), 0)
        np.testing.assert_array_equal(a, ops.make_sparsity_mask(0, 100, 0.5))


class NoiseTest(chex.TestCase):
    def setUp(self):
        super().setUp()
        self.key = jax.random.key(7)
        self.x = jnp.asarray(X_HAND)

    @chex.variants(with_jit=True, without_jit=True)
    def test_relative_gaussian(self):
        fn = self.variant(lambda x, s, k: ops.noise_error("relative_gaussian", x, s, k))
        e = fn(self.x, 0.05, self.key)
        randn = jax.random.normal(self.key, (2, 3), jnp.float32)
        # rtol: XLA may fuse the normal sampler differently under jit (1-ulp differences).
        np.testing.assert_allclose(e, randn * jnp.abs(self.x) * 0.05, rtol=1e-6)
        self.assertGreater(float(jnp.max(jnp.abs(e))), 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_absolute_gaussian(self):
        fn = self.variant(lambda x, s, k: ops.noise_error("absolute_gaussian", x, s, k))
        e = fn(self.x, 0.05, self.key)
        randn = jax.random.normal(self.key, (2, 3), jnp.float32)
        np.testing.assert_allclose(e, randn * 0.05, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_systematic_bias(self):
        # sign(x) * 0.1, key unused; sign(0) = 0.
        x = jnp.asarray([[0.5, -0.004, 0.0]])
        fn = self.variant(lambda x, s: ops.add_noise("systematic_bias", x, s, None))
        np.testing.assert_allclose(fn(x, 0.1), [[0.6, -0.104, 0.0]], rtol=1e-6)
        e = ops.noise_error("systematic_bias", x, 0.1, None)
        np.testing.assert_array_equal(e, np.float32([[0.1, -0.1, 0.0]]))

    def test_bfloat16_dtype(self):
        x = self.x.astype(jnp.bfloat16)
        e = ops.noise_error("relative_gaussian", x, 0.05, self.key)
        self.assertEqual(e.dtype, jnp.bfloat16)
        expected = (
            jax.random.normal(self.key, (2, 3), jnp.float32) * jnp.abs(x.astype(jnp.float32)) * 0.05
        ).astype(jnp.bfloat16)
        np.testing.assert_array_equal(e, expected)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gradient_of_noisy_sum_is_one(self):
        for kind in ops.NOISE_KINDS:
            fn = self.variant(
                jax.grad(lambda x, s, k, kind=kind: jnp.sum(ops.add_noise(kind, x, s, k)))
            )
            # Without stop_gradient, relative noise would give 1 + randn * sign(x) * 0.5.
            np.testing.assert_array_equal(fn(self.x, 0.5, self.key), np.ones((2, 3)))

    def test_draw_waits_for_its_input(self):
        # A key that depends on no data let XLA:CPU draw every site's counters at the program's
        # start and hold them all (the 0.5B noise sampler asked for 40 GB). The compiled temp
        # buffer of a chain of noisy layers must not grow with its length.
        def temp(n):
            def f(x, w, key):
                for i in range(n):
                    x = jnp.tanh(x @ w)
                    k = jax.random.fold_in(key, i)
                    x = x + ops.noise_error("relative_gaussian", x, 0.05, k)
                return x

            x = jnp.ones((256, 256), jnp.float32)
            compiled = jax.jit(f).lower(x, x, self.key).compile()
            return compiled.memory_analysis().temp_size_in_bytes

        self.assertLess(temp(8), 1.1 * temp(2))
        with mock.patch.object(ops, "_after", lambda key, x: key):  # the negative control
            self.assertGreater(temp(8), 2.5 * temp(2))

    def test_nan_input_keeps_a_deterministic_draw(self):
        # The data dependence is a select on x's first element: the same key unless it is NaN.
        x = self.x.at[0, 0].set(jnp.nan)
        e1 = ops.noise_error("relative_gaussian", x, 0.05, self.key)
        e2 = jax.jit(lambda x: ops.noise_error("relative_gaussian", x, 0.05, self.key))(x)
        np.testing.assert_allclose(e1, e2, rtol=1e-6)
        self.assertTrue(np.isnan(e1[0, 0]) and np.isfinite(e1[1:]).all())

    def test_new_scale_does_not_retrace(self):
        traces = []

        @jax.jit
        def f(x, s, k):
            traces.append(1)
            return ops.add_noise("relative_gaussian", x, s, k)

        e1 = f(self.x, 0.1, self.key) - self.x
        e2 = f(self.x, 0.2, self.key) - self.x
        # Same key, twice the scale: twice the error.
        np.testing.assert_allclose(e2, 2 * e1, rtol=1e-5, atol=1e-9)
        self.assertGreater(float(jnp.max(jnp.abs(e1))), 0.0)
        self.assertEqual(len(traces), 1)


# One shared shape for the noisy-linear tests, so compiled code is reused between them:
# 256 x 256 = 65536 elements in each of y, dX and dW (enough for the statistics below).
_RNG = np.random.default_rng(0)
X = _RNG.standard_normal((256, 256), np.float32)
W = (_RNG.standard_normal((256, 256)) / 16.0).astype(np.float32)  # 1/sqrt(256): y ~ N(0, 1)
B = _RNG.standard_normal(256).astype(np.float32)
G = _RNG.standard_normal((256, 256)).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("forward", "backward"))
def _noisy_vjp(x, w, b, g, key, scale, forward=True, backward=True):
    """(y, (dX, dW, db)) of noisy_linear for the fixed cotangent g."""
    f = lambda x, w, b: ops.noisy_linear(x, w, b, key, scale, forward=forward, backward=backward)
    y, vjp = jax.vjp(f, x, w, b)
    return y, vjp(g)


@jax.jit
def _plain_vjp(x, w, b, g):
    y, vjp = jax.vjp(_plain_linear, x, w, b)
    return y, vjp(g)


class NoisyLinearTest(chex.TestCase):
    def setUp(self):
        super().setUp()
        self.key = jax.random.key(11)

    def test_scale_zero_equals_plain(self):
        # scale is a traced argument here, so XLA cannot drop the zero-scaled error term:
        # y + randn * |y| * 0 must still be bit-identical to y.
        y, grads = _noisy_vjp(X, W, B, G, self.key, 0.0)
        y_ref, grads_ref = _plain_vjp(X, W, B, G)
        np.testing.assert_array_equal(y, y_ref)
        for got, want in zip(grads, grads_ref, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            self.assertGreater(float(jnp.max(jnp.abs(want))), 1.0)

    def test_scale_zero_without_bias(self):
        y, grads = _noisy_vjp(X, W, None, G, self.key, 0.0)
        y_ref, grads_ref = _plain_vjp(X, W, None, G)
        np.testing.assert_array_equal(y, y_ref)
        self.assertEqual(len(grads), 3)
        self.assertIsNone(grads[2])
        for got, want in zip(grads[:2], grads_ref[:2], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_three_d_input_by_hand(self):
        # x[b, t] = [1, 2], [3, 4] | [5, 6], [7, 8]; w = [[1, 0, 2], [0, 3, -1]]; b = [0.5, 0, 0].
        # y[b, t] = x[b, t] @ w + b, e.g. [1, 2] @ w + b = [1, 6, 0] + b = [1.5, 6, 0].
        # Cotangent g[b, t] = k * ones(3) with k = 1, 2, 3, 4 in (b, t) order:
        #   dX[b, t] = k * (row sums of w) = k * [3, 2]
        #   dW[i, o] = sum_k k * x_k[i]: i=0: 1*1 + 2*3 + 3*5 + 4*7 = 50; i=1: 2+8+18+32 = 60
        #   db[o] = 1 + 2 + 3 + 4 = 10
        x = jnp.arange(1.0, 9.0).reshape(2, 2, 2)
        w = jnp.asarray([[1.0, 0.0, 2.0], [0.0, 3.0, -1.0]])
        b = jnp.asarray([0.5, 0.0, 0.0])
        k = jnp.arange(1.0, 5.0).reshape(2, 2, 1)
        g = k * jnp.ones((2, 2, 3))
        fn = self.variant(lambda x, w, b, key, s: ops.noisy_linear(x, w, b, key, s))
        y, vjp = jax.vjp(lambda x, w, b: fn(x, w, b, self.key, 0.0), x, w, b)
        np.testing.assert_array_equal(
            y,
            np.float32([[[1.5, 6.0, 0.0], [3.5, 12.0, 2.0]], [[5.5, 18.0, 4.0], [7.5, 24.0, 6.0]]]),
        )
        dx, dw, db = vjp(g)
        np.testing.assert_array_equal(dx, k * jnp.asarray([3.0, 2.0]))
        np.testing.assert_array_equal(dw, np.float32([[50.0, 50.0, 50.0], [60.0, 60.0, 60.0]]))
        np.testing.assert_array_equal(db, np.float32([10.0, 10.0, 10.0]))

    def _assert_relative_error_stats(self, noisy, exact, scale):
        """(noisy - exact) / |exact| ~ N(0, scale^2) elementwise.

        With n = 65536 samples: the sample mean has std scale / 256 ~ 0.004 * scale, so
        |mean| < 0.02 * scale is a 5-sigma bound; the sample std has relative std
        1 / sqrt(2n) ~ 0.28%, so a 2% tolerance is a 7-sigma bound.
        """
        noisy, exact = np.asarray(noisy, np.float64), np.asarray(exact, np.float64)
        self.assertEqual(exact.size, 65536)
        rel = (noisy - exact) / np.abs(exact)
        self.assertLess(abs(rel.mean()), 0.02 * scale)
        np.testing.assert_allclose(rel.std(), scale, rtol=0.02)

    def test_forward_error_statistics(self):
        scale = 0.05
        y, _ = _noisy_vjp(X, W, B, G, self.key, scale)
        y_ref, _ = _plain_vjp(X, W, B, G)
        self._assert_relative_error_stats(y, y_ref, scale)
        # The error is exactly randn(fold_in(key, 0)) * |y| * scale.
        randn = jax.random.normal(jax.random.fold_in(self.key, 0), y.shape, jnp.float32)
        np.testing.assert_allclose(y, y_ref + randn * jnp.abs(y_ref) * scale, rtol=1e-6)

    def test_backward_error_statistics(self):
        scale = 0.05
        _, (dx, dw, db) = _noisy_vjp(X, W, B, G, self.key, scale)
        _, (dx_ref, dw_ref, db_ref) = _plain_vjp(X, W, B, G)
        self._assert_relative_error_stats(dx, dx_ref, scale)
        self._assert_relative_error_stats(dw, dw_ref, scale)
        np.testing.assert_allclose(db, db_ref, rtol=1e-6)  # db carries no error
        # The errors are exactly randn(fold_in(key, 1 or 2)) * |d| * scale.
        for d, d_ref, fold in ((dx, dx_ref, 1), (dw, dw_ref, 2)):
            randn = jax.random.normal(jax.random.fold_in(self.key, fold), d.shape, jnp.float32)
            expected = d_ref + randn * jnp.abs(d_ref) * scale
            np.testing.assert_allclose(d, expected, rtol=2e-5, atol=1e-5)

    def test_forward_only_and_backward_only(self):
        scale = 0.1
        y_ref, grads_ref = _plain_vjp(X, W, B, G)
        # Forward only: output noisy, gradients exact.
        y, grads = _noisy_vjp(X, W, B, G, self.key, scale, forward=True, backward=False)
        self.assertGreater(float(jnp.max(jnp.abs(y - y_ref))), 1e-2)
        for got, want in zip(grads, grads_ref, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        # Backward only: output exact, dX and dW noisy, db exact.
        y, (dx, dw, db) = _noisy_vjp(X, W, B, G, self.key, scale, forward=False, backward=True)
        np.testing.assert_array_equal(y, y_ref)
        self.assertGreater(float(jnp.max(jnp.abs(dx - grads_ref[0]))), 1e-2)
        self.assertGreater(float(jnp.max(jnp.abs(dw - grads_ref[1]))), 1e-2)
        np.testing.assert_allclose(db, grads_ref[2], rtol=1e-6)

    def test_different_keys_give_independent_noise(self):
        y_ref, _ = _plain_vjp(X, W, B, G)
        y1, _ = _noisy_vjp(X, W, B, G, jax.random.key(1), 0.1)
        y2, _ = _noisy_vjp(X, W, B, G, jax.random.key(2), 0.1)
        rel1, rel2 = (y1 - y_ref) / jnp.abs(y_ref), (y2 - y_ref) / jnp.abs(y_ref)
        # Correlation of 65536 independent pairs has std 1/256 ~ 0.004; 0.03 is a 7-sigma bound.
        corr = np.corrcoef(np.ravel(rel1), np.ravel(rel2))[0, 1]
        self.assertLess(abs(corr), 0.03)
        # E|rel1 - rel2| = 0.1 * sqrt(2) * sqrt(2 / pi) ~ 0.113.
        np.testing.assert_allclose(float(jnp.mean(jnp.abs(rel1 - rel2))), 0.1128, rtol=0.03)

    def test_scale_gets_no_gradient_and_does_not_retrace(self):
        x, w, b = X[:8, :16], W[:16, :4], B[:4]
        traces = []

        @jax.jit
        def grads(x, s):
            traces.append(1)
            loss = lambda x, s: jnp.sum(ops.noisy_linear(x, w, b, self.key, s))
            return jax.grad(loss, argnums=(0, 1))(x, s)

        gx1, gs1 = grads(x, 0.1)
        gx2, gs2 = grads(x, 0.3)
        gx0, _ = grads(x, 0.0)
        self.assertEqual(len(traces), 1)
        self.assertEqual((float(gs1), float(gs2)), (0.0, 0.0))
        # Same key, so dX - exact = randn * |exact| * s: the error triples from s 0.1 to 0.3.
        np.testing.assert_allclose(gx2 - gx0, 3 * (gx1 - gx0), rtol=1e-4, atol=1e-6)
        self.assertGreater(float(jnp.max(jnp.abs(gx1 - gx0))), 1e-3)

    def test_bfloat16_gradient_dtypes(self):
        # Output in x's dtype, each gradient cast back to the dtype of x / w / b (here b stays
        # float32 while x and w are bfloat16). Shapes and dtypes only: no compile needed.
        bf16 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        b = jax.ShapeDtypeStruct((4,), jnp.float32)
        out = jax.eval_shape(
            _noisy_vjp, bf16((2, 8, 16)), bf16((16, 4)), b, bf16((2, 8, 4)), self.key, 0.1
        )
        y, (dx, dw, db) = out
        self.assertEqual(
            (y.shape, dx.shape, dw.shape, db.shape), ((2, 8, 4), (2, 8, 16), (16, 4), (4,))
        )
        dtypes = (y.dtype, dx.dtype, dw.dtype, db.dtype)
        self.assertEqual(dtypes, (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.float32))


class BadArgumentsTest(parameterized.TestCase):
    @parameterized.named_parameters(
        (
            "granularity",
            lambda: ops.deadzone(X_HAND, 0.01, granularity="channel"),
            r"granularity='channel'.*tensor.*token.*block",
        ),
        ("grad", lambda: ops.deadzone(X_HAND, 0.01, grad="none"), r"grad='none'.*mask.*ste"),
        (
            "block_size_divides",
            lambda: ops.deadzone(X_HAND, 0.01, granularity="block", block_size=2),
            r"block_size=2.*size 3",
        ),
        (
            "block_size_positive",
            lambda: ops.deadzone(X_HAND, 0.01, granularity="block", block_size=0),
            r"block_size=0",
        ),
        ("threshold", lambda: ops.deadzone(X_HAND, -0.1), r"threshold=-0.1"),
        (
            "sparsity_mask",
            lambda: ops.deadzone(X_HAND, 0.01, sparsity_mask=np.ones(4, bool)),
            r"sparsity_mask.*\(4,\)",
        ),
        ("fraction", lambda: ops.make_sparsity_mask(0, 10, 1.5), r"fraction=1.5.*\[0, 1\]"),
        ("size", lambda: ops.make_sparsity_mask(0, -1, 0.5), r"size=-1"),
        (
            "kind",
            lambda: ops.add_noise("uniform", X_HAND, 0.1, jax.random.key(0)),
            r"kind='uniform'.*relative_gaussian.*absolute_gaussian.*systematic_bias",
        ),
        ("noise_key", lambda: ops.noise_error("relative_gaussian", X_HAND, 0.1, None), r"key=None"),
        (
            "noise_scale",
            lambda: ops.noise_error("absolute_gaussian", X_HAND, -1.0, jax.random.key(0)),
            r"scale=-1.0",
        ),
        (
            "linear_shapes",
            lambda: ops.noisy_linear(
                np.ones((2, 3)), np.ones((4, 5)), None, jax.random.key(0), 0.1
            ),
            r"x.shape=\(2, 3\).*w.shape=\(4, 5\)",
        ),
        (
            "linear_w_rank",
            lambda: ops.noisy_linear(np.ones((2, 3)), np.ones(3), None, jax.random.key(0), 0.1),
            r"w.shape=\(3,\)",
        ),
        (
            "linear_bias",
            lambda: ops.noisy_linear(
                np.ones((2, 3)), np.ones((3, 5)), np.ones(4), jax.random.key(0), 0.1
            ),
            r"b.shape=\(4,\)",
        ),
        (
            "linear_key",
            lambda: ops.noisy_linear(np.ones((2, 3)), np.ones((3, 5)), None, None, 0.1),
            r"key=None",
        ),
        (
            "linear_scale",
            lambda: ops.noisy_linear(
                np.ones((2, 3)), np.ones((3, 5)), None, jax.random.key(0), -0.5
            ),
            r"scale=-0.5",
        ),
    )
    def test_raises(self, call, pattern):
        with pytest.raises(ValueError, match=pattern):
            call()
