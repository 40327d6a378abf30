"""tidepool.attention is tidepool.plan.attention (CUDA's attention kernels
chosen on the meta device), the same module under the name README
documents: `tidepool.attention.cuda_attention` keeps working."""
import sys

from .plan import attention

sys.modules[__name__] = attention
