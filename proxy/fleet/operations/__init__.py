"""The live operations on the workers: drain, undrain, resize, rolling restart and
recycle (`live`; when to recycle: `recycling`), and emptying and stopping a worker
(`decommission`), built from the supervisor's steps and the moves."""
