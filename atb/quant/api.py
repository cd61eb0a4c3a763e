"""tmp"""
from atb.quant.formats import quantize_weight as quantize
def dequantize(w, dtype=None):
    return w.dequantize()
