"""Memory layout: the piece each rank holds of a full tensor (``pieces``), how pieces are packed
into the padded blocks a collective exchanges (``packing``), the working buffers kept between
steps (``buffers``), and torch element types (``dtypes``).
"""
