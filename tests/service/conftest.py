"""Lane "ray" (``tests/lanes.py``): the session service's tests, one after another in one
worker under the cores lock."""

from ..lanes import RAY, folder_lane

pytest_collection_modifyitems = folder_lane(__file__, RAY)
