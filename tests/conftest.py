# The example plugin is a separate distribution; test_writing_a_plugin.py installs it and
# runs its own tests in a subprocess, as its author would.
collect_ignore = ["example_plugin"]
