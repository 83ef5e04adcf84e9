from supervisor.client.cli import main

main()
