"""What a person reads, shown the same way by the report and the explorer (which never import each other).

    style.py     one stylesheet, token chips, number and percentage formats
    findings.py  the paper's finding for each figure, and a sentence on this model's numbers
    summary.py   a run described in rows (model, corpus, options, timings, counts)
"""
