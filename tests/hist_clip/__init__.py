"""hist_clip against drytorch's HistClipper and ParamHistClipper."""
