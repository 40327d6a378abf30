"""tidepool.record: the planner's recorder under the name README documents.
`from tidepool.record import Recorder` gives plan/record.py's Recorder (and
the names of that module's `__all__`); record_training, WORKLOADS and
`python -m tidepool.record WORKLOAD --out trace.csv` are the demos'
(plan/demos.py)."""
from .plan.demos import GENERATION, WORKLOADS, main, record_training  # noqa: F401 - this module's names
from .plan.record import *  # noqa: F401,F403 - the Recorder's names

if __name__ == "__main__":
    main()
