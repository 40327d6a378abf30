"""tidepool.autocast is tidepool.plan.autocast (CUDA's autocast rules on the
meta device), the same module under the name README documents:
`tidepool.autocast.cuda_autocast` keeps working."""
import sys

from .plan import autocast

sys.modules[__name__] = autocast
