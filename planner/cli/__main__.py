"""``python -m autodist.planner.cli`` runs ``autodist-plan``."""

from autodist.planner.cli.main import main

main()  # click exits with the command's status
