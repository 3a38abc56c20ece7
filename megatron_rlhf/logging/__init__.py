"""Out of a run: metrics (metrics.py), the console's quiet start (quiet.py), the
reward-hacking alarm (reward_hacking.py), the report (report.py). Nothing is imported here,
so that quiet.py can filter warnings before torch is imported."""
