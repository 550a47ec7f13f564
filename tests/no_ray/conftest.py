"""Lane "background" (``tests/lanes.py``): everything without Ray, a file per xdist group, at
nice 19 in a session of its own."""

from ..lanes import BACKGROUND, folder_lane

pytest_collection_modifyitems = folder_lane(__file__, BACKGROUND)
