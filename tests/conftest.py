import sys
from pathlib import Path

# Test helpers (tiny models, tokenizers) live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
