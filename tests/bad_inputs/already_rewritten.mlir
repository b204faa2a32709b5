module @jit__lambda attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2, "model"=4]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}, {name = "model", size = 4 : i64}]}}
  func.func public @main(%arg0: tensor<64x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data", "model"}, {}]>}, %arg1: tensor<32x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"model"}]>}) -> (tensor<64x64xf32> {jax.result_info = "result", sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {"model"}]>}) {
    %0 = sdy.manual_computation(%arg0, %arg1) in_shardings=[<@mesh, [{"data", "model"}, {}]>, <@mesh, [{}, {"model"}]>] out_shardings=[<@mesh, [{"data"}, {"model"}]>] manual_axes={"data", "model"} (%arg2: tensor<8x32xf32>, %arg3: tensor<32x16xf32>) {
      %c = stablehlo.constant dense<8> : tensor<ui32>
      %c_0 = stablehlo.constant dense<4> : tensor<ui32>
      %c_1 = stablehlo.constant dense<3> : tensor<ui32>
      %c_2 = stablehlo.constant dense<0> : tensor<ui32>
      %cst = stablehlo.constant dense<0.000000e+00> : tensor<32x16xf32>
      %c_3 = stablehlo.constant dense<[0, 1, 2, 3, 0, 1, 2, 3]> : tensor<8xui32>
      %1 = stablehlo.partition_id : tensor<ui32>
      %2 = stablehlo.dynamic_slice %c_3, %1, sizes = [1] : (tensor<8xui32>, tensor<ui32>) -> tensor<1xui32>
      %3 = stablehlo.reshape %2 : (tensor<1xui32>) -> tensor<ui32>
      %4:3 = stablehlo.while(%iterArg = %c_2, %iterArg_4 = %arg2, %iterArg_5 = %cst) : tensor<ui32>, tensor<8x32xf32>, tensor<32x16xf32>
      cond {
        %c_6 = stablehlo.constant dense<3> : tensor<ui32>
        %10 = stablehlo.compare LT, %iterArg, %c_6, UNSIGNED : (tensor<ui32>, tensor<ui32>) -> tensor<i1>
        stablehlo.return %10 : tensor<i1>
      } do {
        %c_6 = stablehlo.constant dense<1> : tensor<ui32>
        %c_7 = stablehlo.constant dense<0> : tensor<ui32>
        %c_8 = stablehlo.constant dense<8> : tensor<ui32>
        %c_9 = stablehlo.constant dense<4> : tensor<ui32>
        %10 = "stablehlo.collective_permute"(%iterArg_4) <{channel_handle = #stablehlo.channel_handle<handle = 2, type = 1>, source_target_pairs = dense<[[0, 3], [1, 0], [2, 1], [3, 2], [4, 7], [5, 4], [6, 5], [7, 6]]> : tensor<8x2xi64>}> : (tensor<8x32xf32>) -> tensor<8x32xf32>
        %11 = stablehlo.add %3, %iterArg : tensor<ui32>
        %12 = stablehlo.remainder %11, %c_9 : tensor<ui32>
        %13 = stablehlo.dot_general %iterArg_4, %arg3, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
        %14 = stablehlo.multiply %12, %c_8 : tensor<ui32>
        %15 = stablehlo.dynamic_update_slice %iterArg_5, %13, %14, %c_7 : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<ui32>, tensor<ui32>) -> tensor<32x16xf32>
        %16 = stablehlo.add %iterArg, %c_6 : tensor<ui32>
        stablehlo.return %16, %10, %15 : tensor<ui32>, tensor<8x32xf32>, tensor<32x16xf32>
      }
      %5 = stablehlo.add %3, %c_1 : tensor<ui32>
      %6 = stablehlo.remainder %5, %c_0 : tensor<ui32>
      %7 = stablehlo.dot_general %4#1, %arg3, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
      %8 = stablehlo.multiply %6, %c : tensor<ui32>
      %9 = stablehlo.dynamic_update_slice %4#2, %7, %8, %c_2 : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<ui32>, tensor<ui32>) -> tensor<32x16xf32>
      sdy.return %9 : tensor<32x16xf32>
    } : (tensor<64x32xf32>, tensor<32x64xf32>) -> tensor<64x64xf32>
    return %0 : tensor<64x64xf32>
  }
}
