"""tidepool.record is tidepool.plan.record (the planner's recorder), the
same module under the name README documents: `from tidepool.record import
Recorder` and `python -m tidepool.record` keep working."""
import sys

from .plan import record

if __name__ == "__main__":
    record.main()
else:
    sys.modules[__name__] = record
