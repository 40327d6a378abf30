"""tidepool.workload is tidepool.plan.workload (what the planner records),
the same module under the name README documents:
`tidepool.workload.Workload` keeps working."""
import sys

from .plan import workload

sys.modules[__name__] = workload
