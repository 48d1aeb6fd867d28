"""The gateway role: an OpenAI-compatible HTTP endpoint over the bus's inference."""
