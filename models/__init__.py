"""Model adapters, one file per architecture. Importing this package registers all of them."""
# Each architecture file registers itself with models.base.register_adapter on import.
from models import wan  # noqa: F401
from models import qwen_image, z_image  # noqa: F401
from models import sd3, flux  # noqa: F401
