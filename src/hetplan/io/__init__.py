"""Reading and writing hetplan's types (JSON) and importing other tools' profiles."""
