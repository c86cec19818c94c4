"""Measuring on one device: replay R ranks' steps (``fstrain replay``), fit the cost model
(``fstrain calibrate``), and the HTML report of a run (``fstrain report``)."""
