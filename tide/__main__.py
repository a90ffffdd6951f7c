from tide.cli import main

raise SystemExit(main())
