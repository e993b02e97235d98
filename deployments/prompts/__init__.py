"""Turning messages into token ids without Ray: the chat template and the instruction boundary.

    instruction_boundary.py  the verified end of the leading system/developer messages

Imports no Ray: the Renderer deployment, the benchmark's in-process target and tests call it.
"""
