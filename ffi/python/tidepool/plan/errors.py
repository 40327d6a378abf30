"""The planner's errors, in one module that imports none of the others (nor
torch): every module of tidepool.plan raises them and the command
(command.py) tells them apart, without an import circle.
- Exit: ends the command with a message and an exit status (a bad option,
  a card or tidepool command not found);
- PlanError: a bad input, its message names the option, field or file;
- FactoryError: a module: factory raised, its traceback is the message;
- MissingMetaKernel: an operator the meta device cannot run (the
  variant's row says so).
workload.py and step.py give them under their earlier names
(tidepool.workload.PlanError, step.MissingMetaKernel).
"""


class Exit(Exception):
    """Ends the command with a message and an exit status."""

    def __init__(self, message, status=2):
        super().__init__(message)
        self.status = status


class PlanError(Exception):
    """A bad input: the message says which option, field or file."""


class FactoryError(Exception):
    """The user's factory raised: its traceback is the message."""


class MissingMetaKernel(Exception):
    """An operator the meta device cannot run."""
