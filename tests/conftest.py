import sys
from pathlib import Path

# tests/ holds helper modules (distributed.py, workers/) imported by the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))
