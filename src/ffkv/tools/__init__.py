"""Tools built on a run and its analysis: commands that act on memories (locate, attribute, compare, explain,
score) rather than the paper's experiments `ffkv analyze` runs.

Each tool is one module with one job. Tools read runs and use the shared analysis core (`ffkv.experiments`) and
the index; the explorer, the report and the command use them. A tool never imports another layer above it.
"""
