"""Typed config schemas (registered with Hydra) and the start-up checks that span groups."""

from schema.run import GROUP_SCHEMAS, RunConfig, register_schemas

__all__ = ["GROUP_SCHEMAS", "RunConfig", "register_schemas"]
