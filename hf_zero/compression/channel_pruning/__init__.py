"""Hidden-channel pruning: ``config`` (schema), ``layer`` (ChannelMask, ChannelRows), ``apply`` (install + plan)."""

from ..registry import Method, register
from .apply import install, plan_clean
from .config import ChannelPruningParams, ChannelPruningShared
from .layer import ChannelMask, ChannelRows

METHOD = register(Method(name="channel_pruning", install=install, plan_clean=plan_clean))

__all__ = ["ChannelMask", "ChannelRows", "ChannelPruningShared", "ChannelPruningParams", "install", "plan_clean",
           "METHOD"]
