"""Chat formats: the chat data (chat.py), the prompt as the chat template renders it (render.py), a reply
read back into text and tool calls (toolparse.py), the GBNF grammars that constrain a tool call
(grammar.py), the tool-calling families a model's template speaks, with each one's parser and grammar
(families.py, jsoncalls.py for the JSON ones), and chatformat.py, the index the rest of agent/ and node/
import from.

Imports nothing of agent/ (only protocol/): runtime, acting and evaluation build on it.
"""
