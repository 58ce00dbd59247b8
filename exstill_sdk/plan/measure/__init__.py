"""Measuring this machine for the planner: the profiles (exstill-bench profile) and the
planner's check against measured runs (exstill plan --check). Unlike the rest of plan/, these
run the card and a target."""
