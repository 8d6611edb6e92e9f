"""The HTTP side: the aiohttp app and its parts (auth, admin, serving, answers, streaming,
probes), the OpenAI wire models, request parsing and grammar compiling, metrics."""
