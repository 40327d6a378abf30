"""tidepool.record: the planner's recorder under the name README documents.
`from tidepool.record import Recorder` gives plan/record.py's Recorder (and
every other name of that module, its private ones too, as when this module
was that one); record_training, WORKLOADS and `python -m tidepool.record
WORKLOAD --out trace.csv` are the demos' (plan/demos.py)."""
from .plan import record as _record
from .plan.demos import GENERATION, WORKLOADS, main, record_training  # noqa: F401 - this module's names
from .plan.record import *  # noqa: F401,F403 - the Recorder's names


def __getattr__(name):
    """plan/record.py's names that `import *` leaves out."""
    try:
        return getattr(_record, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


if __name__ == "__main__":
    main()
