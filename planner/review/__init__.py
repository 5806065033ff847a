"""Review commands on a plan (show, diff, check, export, render) and the formatting they share."""
