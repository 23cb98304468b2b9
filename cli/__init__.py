"""The ``shardlang`` command: check spec files, plan, show, render and explain reshards.

This is the one place that joins the language (``shardlang``) and the planner (``planner``)
for users; it never imports torch, so the command starts fast.
"""
