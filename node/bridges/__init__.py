"""This node as other ecosystems see it: the OpenAI-compatible endpoint, the A2A agent, MCP servers'
tools mounted as the node's, and what the local HTTP faces share (the API key, the guard that keeps web
pages out, serving on hypercorn). May import core/, net/, door/, models/ and tasks/.
"""
