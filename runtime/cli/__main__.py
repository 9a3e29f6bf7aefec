from edgeprefill.runtime.cli.main import main

main()
