"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), served by translating it to chat."""

from duo.api.anthropic.body import CountTokensBody, MessagesBody
from duo.api.anthropic.route import MessagesApi, add_messages_routes

__all__ = ["CountTokensBody", "MessagesApi", "MessagesBody", "add_messages_routes"]
