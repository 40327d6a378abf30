"""CUDA's autocast rules and attention kernels, applied on the meta device
(tidepool.autocast, tidepool.attention). Needs torch; skipped without it."""
import unittest

try:
    import torch
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


@unittest.skipUnless(HAVE_TORCH, "torch not installed")
class Autocast(unittest.TestCase):
    def setUp(self):
        self.linear = torch.nn.Linear(64, 64, device="meta")
        self.x = torch.randn(8, 64, device="meta")

    def test_matmuls_run_in_the_low_type_and_reductions_and_norms_in_float32(self):
        from tidepool.autocast import cuda_autocast

        with cuda_autocast(torch.bfloat16):
            h = self.linear(self.x)
            self.assertEqual(h.dtype, torch.bfloat16)
            self.assertEqual((h @ h.T).dtype, torch.bfloat16)
            self.assertEqual(torch.softmax(h, -1).dtype, torch.float32)
            self.assertEqual(h.sum().dtype, torch.float32)
            self.assertEqual(torch.nn.functional.layer_norm(h, (64,)).dtype, torch.float32)
            self.assertEqual(h.exp().dtype, torch.float32)
            self.assertEqual(torch.cat([h, self.x]).dtype, torch.float32, "cat promotes to the widest")
            self.assertEqual((h + h).dtype, torch.bfloat16, "other operators keep their inputs' type")
        self.assertEqual(self.linear(self.x).dtype, torch.float32, "nothing changes outside the region")

    def test_a_weight_is_cast_once_per_region_and_the_cast_goes_when_it_exits(self):
        from tidepool.autocast import cuda_autocast
        from tidepool.record import Recorder

        with Recorder(None, cublas_workspace=0) as rec:
            with cuda_autocast(torch.float16):
                for _ in range(3):
                    self.linear(self.x)
                rec.mark("in the region")
            rec.mark("after it")
        casts = [e for e in rec.events if e[1] == "allocate" and e[4] == "aten._to_copy.default" and e[3] == 64 * 64 * 2]
        self.assertEqual(len(casts), 1, "the weight's fp16 copy, made once")
        freed = [e for e in rec.events[rec.marks[0][1]:rec.marks[1][1]] if e[1] == "free" and e[2] == casts[0][2]]
        self.assertEqual(len(freed), 1, "and freed when the region exits")

    def test_disabled_it_does_nothing(self):
        from tidepool.autocast import cuda_autocast

        with cuda_autocast(torch.bfloat16, enabled=False):
            self.assertEqual(self.linear(self.x).dtype, torch.float32)


@unittest.skipUnless(HAVE_TORCH, "torch not installed")
class Attention(unittest.TestCase):
    def largest(self, dtype, mask=None):
        from tidepool.attention import cuda_attention
        from tidepool.record import Recorder

        q = torch.randn(2, 8, 1024, 64, device="meta", dtype=dtype, requires_grad=True)
        with Recorder(None, cublas_workspace=0) as rec, cuda_attention() as attention:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=mask is None).sum().backward()
        return max(e[3] for e in rec.events if e[1] == "allocate"), attention.choices

    def test_no_score_matrix_with_the_fused_kernels_cuda_runs(self):
        scores = 2 * 8 * 1024 * 1024
        largest, choices = self.largest(torch.bfloat16)
        self.assertEqual(choices["flash"], 1)
        self.assertLess(largest, scores * 2, "no (batch, heads, seq, seq) tensor")
        largest, choices = self.largest(torch.float32)
        self.assertEqual(choices["efficient"], 1)
        self.assertLess(largest, scores * 4)

    def test_the_math_path_would_hold_the_scores(self):
        # What the meta device does without cuda_attention: the whole score matrix.
        q = torch.randn(2, 8, 1024, 64, device="meta", requires_grad=True)
        from tidepool.record import Recorder

        with Recorder(None, cublas_workspace=0) as rec:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        self.assertGreaterEqual(max(e[3] for e in rec.events if e[1] == "allocate"), 2 * 8 * 1024 * 1024 * 4)


if __name__ == "__main__":
    unittest.main()
