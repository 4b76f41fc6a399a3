"""The wire layer: codecs, integer lanes, reducers and the cost model.

Pure tensor code and collectives; no model knowledge (shared DESIGN.md, layer 1).
"""
