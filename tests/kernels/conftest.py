"""Lane "background" (``tests/lanes.py``): the kernels' tests, a file per xdist group, started
before the other background files."""

from ..lanes import BACKGROUND, folder_lane

pytest_collection_modifyitems = folder_lane(__file__, BACKGROUND)
