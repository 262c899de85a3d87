"""As in SD.Next: ``modules.scripts`` re-exports ``modules.scripts_manager`` for extensions."""

from modules import scripts_manager  # noqa: F401
from modules.scripts_manager import *  # noqa: F401,F403
from modules.scripts_manager import AlwaysVisible, Script, ScriptRunner, basedir, scripts_data  # noqa: F401
