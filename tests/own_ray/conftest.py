"""Lane "ray-own" (``tests/lanes.py``): tests with a Ray or a timing of their own, one after
another in one worker under the cores lock."""

from ..lanes import OWN_RAY, folder_lane

pytest_collection_modifyitems = folder_lane(__file__, OWN_RAY)
