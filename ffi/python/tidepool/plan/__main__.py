"""`python -m tidepool.plan`: runs the planner's command (command.py)."""
from .command import main

if __name__ == "__main__":
    main()
