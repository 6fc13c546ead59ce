"""Running a calibration at scale: periodic saves and resume after a kill, and torchrun ranks."""
