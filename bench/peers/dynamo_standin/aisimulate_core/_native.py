"""The native module's one name the planner's config validation imports."""

from aisimulate_core.sdk import RustForwardPassPerfModel

__all__ = ["RustForwardPassPerfModel"]
